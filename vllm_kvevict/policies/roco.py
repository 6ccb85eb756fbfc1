"""RoCo: robust cache omission by mean attention and its standard deviation (Ren & Zhu, 2024).

https://arxiv.org/abs/2402.06262
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kvevict.policies.attention_scores import attention_statistics
from vllm_kvevict.policies.base import (
    KeptTokens,
    LayerKV,
    RecentWindowPolicy,
    check_fraction,
    check_int,
)
from vllm_kvevict.policies.kept_masks import robust_selection


@dataclass
class RoCo(RecentWindowPolicy):
    """Prefill form of RoCo, as we read the paper.

    Importance is the *mean* attention a token receives over the queries that can see it (H2O's sum
    divided by that count, so early tokens are not favoured just for being seen more often). Robustness:
    a token whose attention varies a lot (high standard deviation) may matter later even if its mean is
    low, so it is outside the eviction scope. Per KV head, the last ``window`` tokens are kept; of the rest
    of the budget, ``std_ratio`` goes to the highest-std tokens and the remainder to the highest means.
    Statistics are over all given queries (all n prompt queries for the prefill form); the decode-time
    eviction keeps them up to date with ``RocoStatistics``.
    """

    reads_own_values: ClassVar[bool] = False

    window: int = 32
    std_ratio: float = 0.5

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_int(owner, "window", self.window, 0)
        check_fraction(owner, "std_ratio", self.std_ratio, 0.0, 1.0)

    def select(self, layer: LayerKV, budget: int) -> KeptTokens:
        n, kv_heads = layer.num_tokens, layer.num_kv_heads
        if (everything := self.keep_all_or_check(layer, budget)) is not None:
            return everything
        if layer.queries.shape[1] == 0:
            raise ValueError("RoCo needs the prompt queries in LayerKV.queries; got none")
        stats = RocoStatistics.from_prefill(layer)
        window = min(self.window, n)
        candidates = torch.zeros(kv_heads, n, dtype=torch.bool, device=layer.keys.device)
        candidates[:, : n - window] = True
        keep = robust_selection(stats.mean(), stats.std(), budget - window, self.std_ratio, candidates)
        return KeptTokens.from_mask(keep | ~candidates)


class RocoStatistics:
    """Running per-(KV head, token) attention statistics for decode-time RoCo eviction.

    Holds sum, sum of squares and count of the attention each cached token received: [kv_heads, n]
    float32 each. ``update`` adds one decode step's attention row; ``keep`` compacts after an eviction.
    """

    def __init__(self, sums: torch.Tensor, sq_sums: torch.Tensor, counts: torch.Tensor) -> None:
        self.sums = sums
        self.sq_sums = sq_sums
        self.counts = counts

    @classmethod
    def from_prefill(cls, layer: LayerKV) -> RocoStatistics:
        """Statistics of the prompt: over the given queries, each token counting those that see it."""
        mean, std, counts = attention_statistics(layer.queries, layer.keys, layer.positions())
        count = counts.expand_as(mean).clone()
        return cls(mean * count, (std.square() + mean.square()) * count, count)

    @property
    def num_tokens(self) -> int:
        return self.sums.shape[1]

    def update(self, attn_row: torch.Tensor) -> None:
        """Add one query's attention per KV head, attn_row: [kv_heads, m] with m >= the tracked tokens
        (the new tokens appended since the last update come at the end, starting with zero statistics)."""
        kv_heads, m = attn_row.shape
        if kv_heads != self.sums.shape[0] or m < self.num_tokens:
            raise ValueError(
                f"attn_row must be [kv_heads={self.sums.shape[0]}, m >= {self.num_tokens}]; "
                f"got {tuple(attn_row.shape)}"
            )
        self.fold(attn_row[:, None], torch.ones_like(attn_row[:, None], dtype=torch.bool))

    def fold(self, rows: torch.Tensor, seen: torch.Tensor) -> None:
        """Add several queries' attention per KV head at once.

        rows: [kv_heads, T, m] attention rows, m >= the tracked tokens (new ones at the end start at zero);
        seen: [kv_heads, T, m] bool, the (query, entry) pairs that count (the query could see the entry).
        """
        self.fit(rows.shape[2])
        rows = torch.where(seen, rows.float(), 0.0)
        self.sums += rows.sum(dim=1)
        self.sq_sums += rows.square().sum(dim=1)
        self.counts += seen.sum(dim=1)

    def fit(self, m: int) -> None:
        """Grow (zero statistics for the new tokens at the end) or cut the tracked tokens to ``m``."""
        if m > self.num_tokens:
            grow = m - self.num_tokens
            self.sums, self.sq_sums, self.counts = (
                torch.nn.functional.pad(t, (0, grow)) for t in (self.sums, self.sq_sums, self.counts)
            )
        elif m < self.num_tokens:
            self.sums, self.sq_sums, self.counts = (t[:, :m] for t in (self.sums, self.sq_sums, self.counts))

    def reset(self, entries: torch.Tensor) -> None:
        """Zero the statistics where ``entries`` [kv_heads, n] bool is True (a slot now holds a new token)."""
        for t in (self.sums, self.sq_sums, self.counts):
            t.masked_fill_(entries, 0.0)

    def mean(self) -> torch.Tensor:
        """[kv_heads, n] mean attention received."""
        return self.sums / self.counts.clamp(min=1)

    def std(self) -> torch.Tensor:
        """[kv_heads, n] population standard deviation of the attention received."""
        mean = self.mean()
        return (self.sq_sums / self.counts.clamp(min=1) - mean.square()).clamp(min=0).sqrt()

    def eviction_candidates(self, num_evict: int, window: int = 32, std_ratio: float = 0.5) -> torch.Tensor:
        """[kv_heads, num_evict] sorted token indices each head evicts next: the lowest mean attention in
        the eviction scope (not among the last ``window`` tokens nor the most volatile, as in ``RoCo``)."""
        n = self.num_tokens
        candidates = torch.zeros_like(self.sums, dtype=torch.bool)
        candidates[:, : max(0, n - window)] = True
        available = int(candidates[0].sum())
        if not 0 <= num_evict <= available:
            raise ValueError(f"num_evict={num_evict} must be in [0, {available}] (tokens outside the window)")
        keep = robust_selection(self.mean(), self.std(), available - num_evict, std_ratio, candidates)
        evicted = KeptTokens.from_mask(candidates & ~keep)
        return evicted.indices[:, :num_evict]

    def keep(self, indices: torch.Tensor) -> None:
        """Compact to the kept tokens, indices: [kv_heads, m] sorted per head (after an eviction); -1
        entries (a head keeping fewer than m) get zero statistics."""
        present = indices >= 0
        safe = indices.clamp(min=0)
        self.sums, self.sq_sums, self.counts = (
            torch.where(present, t.gather(1, safe), 0.0) for t in (self.sums, self.sq_sums, self.counts)
        )
