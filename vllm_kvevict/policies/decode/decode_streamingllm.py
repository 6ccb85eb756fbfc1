"""StreamingLLM while decoding: attention sinks plus the most recent entries (Xiao et al., 2023).

https://arxiv.org/abs/2309.17453
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.base import check_int
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy, DecodeState
from vllm_kvevict.policies.decode.held_layer import HeldLayer


@dataclass
class DecodeStreamingLLM(DecodeEvictionPolicy):
    """Keeps the entries at the first ``sinks`` positions and the newest ``cap - sinks``; no scoring, no
    queries, no state."""

    sinks: int = 4

    def __post_init__(self) -> None:
        check_int(type(self).__name__, "sinks", self.sinks, 0)

    @property
    def min_cap(self) -> int:
        return max(1, self.sinks)

    def scores(self, state: DecodeState | None, held: HeldLayer) -> torch.Tensor:
        # Recency is the score: newer positions first; sinks are always kept.
        key_positions = held.positions
        scores = key_positions.float()
        return scores.masked_fill((key_positions >= 0) & (key_positions < self.sinks), float("inf"))
