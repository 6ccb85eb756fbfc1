"""StreamingLLM: attention sinks plus the most recent tokens (Xiao et al., 2023).

https://arxiv.org/abs/2309.17453
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kvevict.policies.base import LayerKV, ScoredPolicy, check_int


@dataclass
class StreamingLLM(ScoredPolicy):
    """Keeps the first ``sinks`` tokens and the last ``budget - sinks``, whatever the attention
    (kvpress's StreamingLLMPress). Needs no queries, so its decode form is this scorer wrapped
    (``decode/decode_scored.py``): recency is an entry's own score, whenever it is judged."""

    reads_own_values: ClassVar[bool] = False
    #: what the decode wrapper reads of the held entries: their positions only (``ScoredDecode``)
    reads_keys: ClassVar[bool] = False

    sinks: int = 4

    def __post_init__(self) -> None:
        check_int(type(self).__name__, "sinks", self.sinks, 0)

    @property
    def min_budget(self) -> int:
        return self.sinks

    def always_kept(self, num_tokens: int, budget: int) -> torch.Tensor:
        if budget >= num_tokens:
            return torch.arange(num_tokens)
        sinks = torch.arange(min(self.sinks, num_tokens))
        recent = torch.arange(num_tokens - (budget - self.sinks), num_tokens)
        return torch.cat([sinks, recent])

    def entry_scores(self, layer: LayerKV) -> torch.Tensor:
        """[H, n] float32: each entry's position (``LayerKV.key_positions``, else its index): recency."""
        if layer.key_positions is not None:
            return layer.key_positions.float()
        n = layer.num_tokens
        return torch.arange(n, dtype=torch.float32, device=layer.keys.device).expand(layer.num_kv_heads, n)

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        # Recency is the score: later tokens first; sinks are always kept.
        scores = self.entry_scores(layer).clone()
        scores[:, : self.sinks] = float("inf")
        return scores

