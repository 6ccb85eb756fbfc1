"""H2O, prefill form: heavy hitters by accumulated attention plus a recent window (Zhang et al., 2023).

https://arxiv.org/abs/2306.14048
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kvevict.policies.attention_scores import accumulated_attention, group_mean
from vllm_kvevict.policies.base import LayerKV, RecentWindowPolicy, ScoredPolicy, check_int


@dataclass
class H2O(RecentWindowPolicy, ScoredPolicy):
    """Score = column sum of the causal attention matrix over every prompt query (the "heavy hitters"),
    averaged over the GQA group; the last ``window`` tokens are always kept (H2O's recent part).

    Needs all n prompt queries in ``LayerKV.queries`` (``query_window(n) == n``); they are walked in
    chunks, never as an n x n matrix. Given fewer queries it accumulates over those.
    """

    reads_own_values: ClassVar[bool] = False

    window: int = 32

    def __post_init__(self) -> None:
        check_int(type(self).__name__, "window", self.window, 0)

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        if layer.queries.shape[1] == 0:
            raise ValueError("H2O needs the prompt queries in LayerKV.queries; got none")
        accumulated = accumulated_attention(layer.queries, layer.keys, layer.positions())
        scores = group_mean(accumulated, layer.num_kv_heads)
        scores[:, max(0, layer.num_tokens - self.window) :] = float("inf")
        return scores
