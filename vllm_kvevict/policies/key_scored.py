"""Policies that judge a token by its key alone, with no queries: they can judge a prompt before its question
has arrived (between chunks of a chunked prefill)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kvevict.policies.attention_scores import extend_forward
from vllm_kvevict.policies.base import LayerKV, ScoredPolicy, check_int


@dataclass
class KeyScoredPolicy(ScoredPolicy):
    """One score per key (``key_scores``), higher kept first. The first ``sinks`` and the last ``window``
    tokens are always kept (continuity for the next chunk). ``span_after`` (ours, as in SnapKV; 0 is the
    papers' rule): each token also takes the score of the ``span_after`` tokens before it, so a kept key
    keeps the run that follows it (a needle's value after its key phrase).
    """

    reads_own_values: ClassVar[bool] = False

    window: int = 32
    sinks: int = 4
    span_after: int = 8

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_int(owner, "window", self.window, 0)
        check_int(owner, "sinks", self.sinks, 0)
        check_int(owner, "span_after", self.span_after, 0)

    @property
    def min_budget(self) -> int:
        return self.window + self.sinks

    def always_kept(self, num_tokens: int, budget: int) -> torch.Tensor:
        return sinks_and_recent(num_tokens, self.sinks, self.window)

    @abstractmethod
    def key_scores(self, keys: torch.Tensor) -> torch.Tensor:
        """[H, n] float32 scores of keys [H, n, d] float32 (higher kept first)."""

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        scores = extend_forward(self.key_scores(layer.keys.float()), self.span_after)  # [H, n]
        forced = self.always_kept(layer.num_tokens, budget).to(scores.device)
        scores[:, forced] = float("inf")
        return scores


def sinks_and_recent(num_tokens: int, sinks: int, window: int) -> torch.Tensor:
    """[k] int64 positions of the first ``sinks`` and the last ``window`` of ``num_tokens`` tokens."""
    first = torch.arange(min(sinks, num_tokens))
    recent = torch.arange(max(sinks, num_tokens - window), num_tokens)
    return torch.cat([first, recent])
