"""Decode states: running attention statistics per held entry, with the two methods scored from them (H2O,
Zhang et al., 2023, https://arxiv.org/abs/2306.14048; RoCo, Ren & Zhu, 2024, https://arxiv.org/abs/2402.06262),
and last-window scores (SnapKV).

They keep state where a prefill scorer wrapped (``decode_scored.py``) keeps none: their score of an entry is
the attention it received from every query since it was held, and those queries are gone once folded in (the
caller keeps at most ``max_interval``), so the sums are carried from re-score to re-score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import check_fraction, check_int
from vllm_kvevict.policies.decode.decode_policy import (
    DecodeEvictionPolicy,
    DecodeState,
    fit_width,
    gather_padded,
    held_attention,
    recent_entries,
)
from vllm_kvevict.policies.decode.held_layer import HeldLayer
from vllm_kvevict.policies.kept_masks import top_k_mask
from vllm_kvevict.policies.roco import RocoStatistics


class AttentionStatistics(DecodeState):
    """Sum, sum of squares and count of the attention each held entry received from the queries that saw
    it ([kv_heads, L] each, in ``stats``, a ``RocoStatistics``), GQA rows being the mean over each query
    group. ``observed_upto`` (a 0-d int64 tensor) is the newest query position folded in: queries at or
    before it are skipped, so the caller may pass its whole ring buffer at every re-score."""

    def __init__(self, num_kv_heads: int, device: torch.device | str) -> None:
        empty = torch.zeros(num_kv_heads, 0, device=device)
        self.stats = RocoStatistics(empty, empty.clone(), empty.clone())
        self.positions = torch.full((num_kv_heads, 0), -1, dtype=torch.int64, device=device)
        self.observed_upto = torch.tensor(-1, dtype=torch.int64, device=device)

    def observe(
        self,
        keys: torch.Tensor,
        key_positions: torch.Tensor,
        queries: torch.Tensor,
        query_positions: torch.Tensor,
    ) -> None:
        """Fold the not yet seen queries in (shapes as ``DecodeEvictionPolicy.observe``)."""
        self.fit(key_positions)
        query_positions = query_positions.to(device=keys.device, dtype=torch.int64)
        probs, visible = held_attention(keys, key_positions, queries, query_positions)
        new = query_positions > self.observed_upto
        self.stats.fold(probs.mean(dim=1), visible & new[None, :, None])
        if query_positions.numel():
            self.observed_upto = torch.maximum(self.observed_upto, query_positions.max())

    def fit(self, key_positions: torch.Tensor) -> None:
        """Align to the caller's slots: new entries start with zero statistics."""
        changed = self.align(key_positions)
        self.stats.fit(key_positions.shape[1])
        self.stats.reset(changed)

    def keep(self, kept_indices: torch.Tensor) -> None:
        self.stats.keep(kept_indices)
        self.keep_positions(kept_indices)


class WindowScores(DecodeState):
    """Scores of the held entries from the last observation window ([kv_heads, L] float32, -inf for
    entries the window has not scored), replaced at every ``observe``."""

    def __init__(self, num_kv_heads: int, device: torch.device | str) -> None:
        self.values = torch.zeros(num_kv_heads, 0, device=device)
        self.positions = torch.full((num_kv_heads, 0), -1, dtype=torch.int64, device=device)

    def fit(self, key_positions: torch.Tensor) -> None:
        """Align to the caller's slots: entries not scored yet get -inf."""
        changed = self.align(key_positions)
        self.values = fit_width(self.values, key_positions.shape[1], float("-inf"))
        self.values = self.values.masked_fill(changed, float("-inf"))

    def keep(self, kept_indices: torch.Tensor) -> None:
        self.values = gather_padded(self.values, kept_indices, float("-inf"))
        self.keep_positions(kept_indices)


@dataclass
class AccumulatingPolicy(DecodeEvictionPolicy):
    """A method scored from ``AttentionStatistics`` (H2O, RoCo): every query must be folded in, so the
    caller keeps ``max_interval`` queries and re-scores at least that often (``check_interval``); queries
    already folded are skipped, so overlap is harmless. The newest ``window`` positions are always kept."""

    window: int = 32
    max_interval: int = 128

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_int(owner, "window", self.window, 0)
        check_int(owner, "max_interval", self.max_interval, 1)

    @property
    def query_window(self) -> int:
        return self.max_interval

    @property
    def min_cap(self) -> int:
        return max(1, self.window)

    def queries_needed(self, interval: int) -> int:
        # Queries already folded are skipped: only the ones since the last re-score are needed.
        return min(self.max_interval, interval)

    def check_interval(self, interval: int) -> None:
        super().check_interval(interval)
        if interval > self.max_interval:
            raise ValueError(
                f"{self._label()}: interval={interval} exceeds max_interval={self.max_interval}: the "
                "queries between re-scores would not all be seen; raise max_interval"
            )

    def init_state(self, num_kv_heads: int, device: torch.device | str) -> AttentionStatistics:
        return AttentionStatistics(num_kv_heads, device)

    def observe(
        self,
        state: DecodeState | None,
        held: HeldLayer,
        queries: torch.Tensor,
        query_positions: torch.Tensor,
    ) -> AttentionStatistics:
        state = self.statistics(state, held.positions)
        state.observe(held.key_rows(self._label()), held.positions, queries, query_positions)
        return state

    def statistics(self, state: DecodeState | None, key_positions: torch.Tensor) -> AttentionStatistics:
        """``state`` aligned to the caller's slots ``key_positions``."""
        if not isinstance(state, AttentionStatistics):
            raise ValueError(f"{self._label()} needs the state from its init_state; got {state!r}")
        state.fit(key_positions)
        return state


@dataclass
class DecodeH2O(AccumulatingPolicy):
    """H2O while decoding. Score = attention accumulated over every query since the entry was held (a KV
    head's row being the mean over its query group); the newest ``window`` positions are always kept."""

    def scores(self, state: DecodeState | None, held: HeldLayer) -> torch.Tensor:
        accumulated = self.statistics(state, held.positions).stats.sums.clone()
        return accumulated.masked_fill(recent_entries(held.positions, self.window), float("inf"))


@dataclass
class DecodeRoCo(AccumulatingPolicy):
    """RoCo while decoding. Importance is the *mean* attention over the queries that saw an entry (old entries
    are not favoured for being seen more often, as with H2O's sum). Per head, the newest ``window`` positions
    are kept; of the rest of the cap, ``std_ratio`` goes to the entries with the most volatile attention
    (highest std-dev: outside the eviction scope) and the remainder to the highest means, as the prefill
    ``RoCo``. ``sinks`` > 0 also always keeps the first ``sinks`` positions, as StreamingLLM does (0: the
    paper).
    """

    std_ratio: float = 0.5
    sinks: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fraction(type(self).__name__, "std_ratio", self.std_ratio, 0.0, 1.0)
        check_int(type(self).__name__, "sinks", self.sinks, 0)

    @property
    def min_cap(self) -> int:
        return max(1, self.window + self.sinks)

    def protected(self, key_positions: torch.Tensor) -> torch.Tensor:
        """[kv_heads, L] bool: the recent window and the sinks, kept whatever their statistics."""
        sinks = (key_positions >= 0) & (key_positions < self.sinks)
        return recent_entries(key_positions, self.window) | sinks

    def scores(self, state: DecodeState | None, held: HeldLayer) -> torch.Tensor:
        """Mean attention, ``+inf`` for the recent window and the sinks (what Ada-style caps rank by)."""
        mean = self.statistics(state, held.positions).stats.mean()
        return mean.masked_fill(self.protected(held.positions), float("inf"))

    def keep_mask(self, state: DecodeState | None, held: HeldLayer, caps: torch.Tensor) -> torch.Tensor:
        key_positions = held.positions
        stats = self.statistics(state, key_positions).stats
        recent = self.protected(key_positions)
        scope = (key_positions >= 0) & ~recent
        rest = (caps - recent.sum(dim=1)).clamp(min=0)
        # selection.robust_selection with a per-head k: the most volatile entries leave the scope first.
        volatile = top_k_mask(stats.std(), torch.round(self.std_ratio * rest), eligible=scope)
        by_mean = top_k_mask(stats.mean(), rest - volatile.sum(dim=1), eligible=scope & ~volatile)
        return recent | volatile | by_mean
