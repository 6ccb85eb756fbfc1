"""The question before the document: the needle tasks with their instruction and question at the top of the
user turn, so the prompt's last tokens are document text, not the question (RAG templates, "answer from the
following..." prompts). Methods that judge the prompt by its last window of queries lose their pointer.

Each task draws the same needles and haystack as the task it wraps (same seeds, ``seed_name``); only the
order of the parts and the wording that placed the question after the text change. The answer prefix of
the wrapped task repeats the question (its key), which would hand the last window the question again, so
the assistant turn starts empty, as in a plain chat request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm_kvevict.evaluation.tasks.base import Layout
from vllm_kvevict.evaluation.tasks.placed_question import PlacedQuestion

#: Said before the question, which comes before the text.
INSTRUCTION = (
    "Some special magic numbers are hidden within the text below. Read it, then answer this question."
)
#: The assistant turn's start: empty, so the prompt's end holds no part of the question.
ANSWER_PREFIX = ""
#: The family's name prefix.
PREFIX = "qfirst_"


@dataclass(frozen=True)
class QuestionFirst(PlacedQuestion):
    """``inner``'s prompt with the question before the document in the user turn."""

    prefix: ClassVar[str] = PREFIX
    layout: ClassVar[Layout] = "question_first"
    instruction: ClassVar[str] = INSTRUCTION
    placement: ClassVar[str] = "the question before the text"
