"""RULER's scorers: case-insensitive substring match of the reference answers in the model's output."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_kvevict.evaluation.tasks.base import Metric


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` found in ``output`` (RULER string_match_all, per sample, in [0, 1])."""
    if not answers:
        raise ValueError("a sample needs at least one reference answer")
    text = output.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


def string_match_part(output: str, answers: Sequence[str]) -> float:
    """1.0 if any of ``answers`` is found in ``output``, else 0.0 (RULER string_match_part, per sample)."""
    if not answers:
        raise ValueError("a sample needs at least one reference answer")
    text = output.lower()
    return float(any(answer.lower() in text for answer in answers))


SCORERS = {"all": string_match_all, "part": string_match_part}


def score(output: str, answers: Sequence[str], metric: Metric) -> float:
    """Score ``output`` against ``answers`` with the task's ``metric``."""
    if metric not in SCORERS:
        raise ValueError(f"unknown metric {metric!r}; valid metrics: {', '.join(SCORERS)}")
    return SCORERS[metric](output, answers)
