"""Needle tasks with the question placed where a chat header cannot point to it: families that wrap a
question-last task and move its instruction and question (``TaskParts.layout``).

Each family draws the same needles and haystack as the task it wraps (same seeds, ``seed_name``); only the
parts' order and the wording that placed the question after the text change. The wrapped task's answer
prefix repeats the question (its key), which would hand the prompt's last window the question again, so the
answer starts empty.

- ``qsystem_<task>``: the instruction and question in the system message, the document as the user turn
  (how a RAG application pins the task while users paste documents). The last user turn is the document.
- ``rag_<task>``: a plain completion prompt, "Question: … Context: … Answer:", no chat template at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from vllm_kvevict.evaluation.tasks.base import Layout, Metric, Task, TaskParts


@dataclass(frozen=True)
class PlacedQuestion:
    """``inner``'s parts with the instruction and question moved (``layout``); a family per subclass."""

    inner: Task

    prefix: ClassVar[str]
    layout: ClassVar[Layout]
    instruction: ClassVar[str]
    placement: ClassVar[str]

    @property
    def name(self) -> str:
        return f"{self.prefix}{self.inner.name}"

    @property
    def seed_name(self) -> str:
        """The wrapped task's name: samples draw the same documents as the question-last task."""
        return getattr(self.inner, "seed_name", self.inner.name)

    @property
    def description(self) -> str:
        return f"{self.inner.description}; {self.placement}"

    @property
    def metric(self) -> Metric:
        return self.inner.metric

    @property
    def max_new_tokens(self) -> int:
        return self.inner.max_new_tokens

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts:
        parts = self.inner.build(seed, units, target_tokens)
        return replace(parts, instruction=self.instruction, answer_prefix="", layout=self.layout)


@dataclass(frozen=True)
class QuestionInSystem(PlacedQuestion):
    """The question in the system message, the document as the user turn."""

    prefix: ClassVar[str] = "qsystem_"
    layout: ClassVar[Layout] = "question_in_system"
    instruction: ClassVar[str] = (
        "Some special magic numbers are hidden within the document the user sends. Read it, then answer "
        "this question."
    )
    placement: ClassVar[str] = "the question in the system message, the document as the user turn"


@dataclass(frozen=True)
class CompletionQuestionFirst(PlacedQuestion):
    """A plain completion prompt with the question before the context and no chat template."""

    prefix: ClassVar[str] = "rag_"
    layout: ClassVar[Layout] = "completion_question_first"
    instruction: ClassVar[str] = (
        "Some special magic numbers are hidden within the context below. Answer the question from it."
    )
    placement: ClassVar[str] = "a plain completion prompt, the question before the context"
