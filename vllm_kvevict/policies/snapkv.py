"""SnapKV: keep the prompt tokens the observation window attends to (Li et al., 2024).

https://arxiv.org/abs/2404.14469
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Self

import torch

from vllm_kvevict.policies.attention_scores import (
    check_window_pooling,
    extend_forward,
    group_mean,
    pool_scores,
    window_attention,
)
from vllm_kvevict.policies.base import EvictionPolicy, LayerKV, ScoredPolicy, check_int


class ObservationWindowPolicy(EvictionPolicy):
    """A method judged by the queries of its last ``window`` prompt tokens, which it always keeps (SnapKV,
    NaCl); the question echo's queries can join them (``with_echo_queries``)."""

    window: int
    #: queries placed after the prompt that judge beside the window (the question echo,
    #: ``datapath/question_echo.py``); set on a copy by ``with_echo_queries``, not a method parameter
    echo_queries: ClassVar[int] = 0

    @property
    def min_budget(self) -> int:
        return self.window

    def query_window(self, num_tokens: int) -> int:
        return min(self.window, num_tokens) + self.echo_queries

    def with_echo_queries(self, count: int) -> Self:
        """A copy judged by its window and ``count`` more queries after the prompt (``LayerKV.queries`` then
        ends with them, their positions >= n); it keeps the same window."""
        echoed = copy.copy(self)
        echoed.echo_queries = count
        return echoed

    def always_kept(self, num_tokens: int, budget: int) -> torch.Tensor:
        return torch.arange(max(0, num_tokens - self.window), num_tokens)


@dataclass
class SnapKV(ObservationWindowPolicy, ScoredPolicy):
    """Score = attention of the last ``window`` prompt queries, averaged over them, pooled over
    neighbouring tokens, averaged over the GQA group; the window itself is always kept.

    As in kvpress's SnapKVPress the softmax runs over all n keys but only the n - window tokens before the
    window are scored and pooled (zero/-inf padding at their end), then the window is appended as kept.
    kvpress defaults: window 64, ``pooling="avg"``, kernel 5; the paper and we: window 32, max pooling, 7.
    ``span_after`` (ours; 0 is the paper's SnapKV): after pooling, each token also takes the score of the
    ``span_after`` tokens before it, so a kept peak keeps the run that follows it (``extend_forward``).
    Copying a multi-token answer reads that run token by token; with 0 the bundled model wrote truncated
    numbers (docs/policies.md, "Answer tails"), so the product default is 8.
    """

    reads_own_values: ClassVar[bool] = False

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    span_after: int = 8

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_window_pooling(owner, self.window, self.kernel, self.pooling)
        check_int(owner, "span_after", self.span_after, 0)

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        n = layer.num_tokens
        window = min(self.window, n)
        queries, positions = window_queries(layer, window + self.echo_queries, type(self).__name__)
        attention = window_attention(queries, layer.keys, positions)[:, : n - window]
        pooled = extend_forward(pool_scores(attention, self.kernel, self.pooling), self.span_after)
        scores = group_mean(pooled, layer.num_kv_heads)
        kept_window = torch.full((layer.num_kv_heads, window), float("inf"), device=scores.device)
        return torch.cat([scores, kept_window], dim=1)


def window_queries(layer: LayerKV, window: int, owner: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``window`` queries of ``layer`` and their positions: ([q_heads, window, d], [window])."""
    given = layer.queries.shape[1]
    if given < window:
        raise ValueError(
            f"{owner} needs the last {window} prompt queries (its window) in LayerKV.queries; got {given}"
        )
    return layer.queries[:, given - window :], layer.positions()[given - window :]
