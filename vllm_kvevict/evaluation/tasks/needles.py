"""Needle sentences of RULER's needle-in-a-haystack families, shared by the single/multi-needle tasks."""

from __future__ import annotations

import random

from vllm_kvevict.evaluation.vocabulary import magic_key, magic_number

INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)


def needle(key: str, value: str) -> str:
    """The sentence that hides ``value`` under ``key``."""
    return f"One of the special magic numbers for {key} is: {value}."


def distinct_keys(rng: random.Random, count: int) -> list[str]:
    """``count`` different needle keys."""
    keys: list[str] = []
    while len(keys) < count:
        key = magic_key(rng)
        if key not in keys:
            keys.append(key)
    return keys


def distinct_values(rng: random.Random, count: int) -> list[str]:
    """``count`` different 7-digit needle values."""
    values: list[str] = []
    while len(values) < count:
        value = magic_number(rng)
        if value not in values:
            values.append(value)
    return values


def sorted_depths(rng: random.Random, count: int) -> list[float]:
    """``count`` random depths in [0, 1], ascending, so needles keep their order in the text."""
    return sorted(rng.random() for _ in range(count))
