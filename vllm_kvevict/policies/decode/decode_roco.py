"""RoCo while decoding: mean attention received, with the standard-deviation eviction scope (Ren & Zhu,
2024). https://arxiv.org/abs/2402.06262
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import check_fraction, check_int
from vllm_kvevict.policies.decode.decode_policy import DecodeState, recent_entries
from vllm_kvevict.policies.decode.decode_states import AccumulatingPolicy
from vllm_kvevict.policies.decode.held_layer import HeldLayer
from vllm_kvevict.policies.kept_masks import top_k_mask


@dataclass
class DecodeRoCo(AccumulatingPolicy):
    """Importance is the *mean* attention over the queries that saw an entry (old entries are not favoured
    for being seen more often, as with H2O's sum). Per head, the newest ``window`` positions are kept; of
    the rest of the cap, ``std_ratio`` goes to the entries with the most volatile attention (highest
    std-dev: outside the eviction scope) and the remainder to the highest means, as the prefill ``RoCo``.
    ``sinks`` > 0 also always keeps the first ``sinks`` positions, as StreamingLLM does (0: the paper).
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
