"""What a task is: a seeded builder of prompt parts whose size grows with a number of units."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

Metric = Literal["all", "part"]
Layout = Literal["question_last", "question_first", "question_in_system", "completion_question_first"]
"""Where the question sits: after the context in the user turn (``question_last``), before it in the user turn
(``question_first``), in the system message with the context as the user turn (``question_in_system``), or
before the context in a plain completion prompt with no chat template (``completion_question_first``)."""
LAYOUTS: tuple[Layout, ...] = (
    "question_last",
    "question_first",
    "question_in_system",
    "completion_question_first",
)
"""RULER's scorers: ``all`` = fraction of the reference answers found in the output (string_match_all),
``part`` = 1 if any reference answer is found (string_match_part)."""


@dataclass(frozen=True)
class TaskParts:
    """The pieces of one prompt, before the chat template, and what a correct answer contains."""

    instruction: str
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    unique_in_context: tuple[str, ...] = ()
    """Strings that must occur exactly once in the context (needle keys and values); checked on generation."""
    layout: Layout = "question_last"
    """Where the instruction and question sit relative to the context (``Layout``)."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not valid; valid: {', '.join(LAYOUTS)}")


class Task(Protocol):
    """A task family. ``build(seed, units, target_tokens)`` is pure: the same arguments give the same parts,
    and the prompt grows with ``units`` (haystack words, list entries, examples)."""

    name: str
    description: str
    metric: Metric
    max_new_tokens: int

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts: ...
