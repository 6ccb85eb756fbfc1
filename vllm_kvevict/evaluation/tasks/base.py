"""What a task is: a seeded builder of prompt parts whose size grows with a number of units."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

Metric = Literal["all", "part"]
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
    question_first: bool = False
    """The instruction and question open the user turn and the context follows them (else the question
    follows the context)."""


class Task(Protocol):
    """A task family. ``build(seed, units, target_tokens)`` is pure: the same arguments give the same parts,
    and the prompt grows with ``units`` (haystack words, list entries, examples)."""

    name: str
    description: str
    metric: Metric
    max_new_tokens: int

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts: ...
