"""Shared inputs of the layout tests."""

from __future__ import annotations

import itertools
import random

import torch


def ragged_counts(total: int, heads: int, cap: int, rng: random.Random) -> list[int]:
    """A random split of ``total`` kept tokens over ``heads`` heads, each <= cap (Ada-KV-like)."""
    weights = [rng.random() ** 3 + 1e-6 for _ in range(heads)]
    counts = [min(cap, int(total * w / sum(weights))) for w in weights]
    for h in itertools.cycle(rng.sample(range(heads), heads)):
        if sum(counts) == total:
            break
        counts[h] += min(cap - counts[h], total - sum(counts))
    return counts


def block_table_of(rows: dict[str, list[int]], req_ids: list[str], width: int) -> torch.Tensor:
    """[R, width] int32 vLLM block table of ``req_ids`` in batch order from their block rows (0-padded)."""
    table = torch.zeros(len(req_ids), width, dtype=torch.int32)
    for i, req_id in enumerate(req_ids):
        table[i, : len(rows[req_id])] = torch.tensor(rows[req_id])
    return table
