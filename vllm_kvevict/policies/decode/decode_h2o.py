"""H2O while decoding: heavy hitters by accumulated attention plus the recent entries (Zhang et al., 2023).

https://arxiv.org/abs/2306.14048
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.decode.decode_policy import DecodeState, recent_entries
from vllm_kvevict.policies.decode.decode_states import AccumulatingPolicy
from vllm_kvevict.policies.decode.held_layer import HeldLayer


@dataclass
class DecodeH2O(AccumulatingPolicy):
    """Score = attention accumulated over every query since the entry was held (a KV head's row being the
    mean over its query group); the newest ``window`` positions are always kept."""

    def scores(self, state: DecodeState | None, held: HeldLayer) -> torch.Tensor:
        accumulated = self.statistics(state, held.positions).stats.sums.clone()
        return accumulated.masked_fill(recent_entries(held.positions, self.window), float("inf"))
