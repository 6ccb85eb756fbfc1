"""The question before the document: the needle tasks with their instruction and question at the top of the
user turn, so the prompt's last tokens are document text, not the question (RAG templates, "answer from the
following..." prompts). Methods that judge the prompt by its last window of queries lose their pointer.

Each task draws the same needles and haystack as the task it wraps (same seeds, ``seed_name``); only the
order of the parts and the wording that placed the question after the text change. The answer prefix of
the wrapped task repeats the question (its key), which would hand the last window the question again, so
the assistant turn starts empty, as in a plain chat request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_kvevict.evaluation.tasks.base import Metric, Task, TaskParts

#: Said before the question, which comes before the text.
INSTRUCTION = (
    "Some special magic numbers are hidden within the text below. Read it, then answer this question."
)
#: The assistant turn's start: empty, so the prompt's end holds no part of the question.
ANSWER_PREFIX = ""
#: The family's name prefix.
PREFIX = "qfirst_"


@dataclass(frozen=True)
class QuestionFirst:
    """``inner``'s prompt with the question before the document (``TaskParts.question_first``)."""

    inner: Task

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.inner.name}"

    @property
    def seed_name(self) -> str:
        """The wrapped task's name: samples draw the same documents as the question-last task."""
        return getattr(self.inner, "seed_name", self.inner.name)

    @property
    def description(self) -> str:
        return f"{self.inner.description}; the question before the text"

    @property
    def metric(self) -> Metric:
        return self.inner.metric

    @property
    def max_new_tokens(self) -> int:
        return self.inner.max_new_tokens

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts:
        parts = self.inner.build(seed, units, target_tokens)
        return replace(parts, instruction=INSTRUCTION, answer_prefix=ANSWER_PREFIX, question_first=True)
