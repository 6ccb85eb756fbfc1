"""Shared inputs of the layout tests."""

from __future__ import annotations

import itertools
import random


def ragged_counts(total: int, heads: int, cap: int, rng: random.Random) -> list[int]:
    """A random split of ``total`` kept tokens over ``heads`` heads, each <= cap (Ada-KV-like)."""
    weights = [rng.random() ** 3 + 1e-6 for _ in range(heads)]
    counts = [min(cap, int(total * w / sum(weights))) for w in weights]
    for h in itertools.cycle(rng.sample(range(heads), heads)):
        if sum(counts) == total:
            break
        counts[h] += min(cap - counts[h], total - sum(counts))
    return counts
