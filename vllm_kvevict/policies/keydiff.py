"""KeyDiff: keep the keys least like the others, with no queries (Park et al., 2025).

https://arxiv.org/abs/2504.15364
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from vllm_kvevict.policies.base import LayerKV, ScoredPolicy, check_int
from vllm_kvevict.policies.scoring import extend_forward


@dataclass
class KeyDiff(ScoredPolicy):
    """Score = minus the cosine similarity of a token's key to its head's anchor, the mean of the
    L2-normalised keys of the scored tokens: distinctive keys are kept first. It needs no observation
    window, so it can judge a prompt before its question has arrived (between chunks of a chunked prefill).
    The first ``sinks`` and the last ``window`` tokens are always kept (continuity for the next chunk).
    ``span_after`` (ours, as in SnapKV; 0 is the paper's KeyDiff): each token also takes the score of the
    ``span_after`` tokens before it, so a distinctive key keeps the run that follows it (a needle's value
    after its key phrase).
    """

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
        sinks = torch.arange(min(self.sinks, num_tokens))
        recent = torch.arange(max(self.sinks, num_tokens - self.window), num_tokens)
        return torch.cat([sinks, recent])

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        keys = F.normalize(layer.keys.float(), dim=-1)  # [H, n, d]
        anchor = F.normalize(keys.mean(dim=1, keepdim=True), dim=-1)  # [H, 1, d]
        scores = extend_forward(-(keys * anchor).sum(dim=-1), self.span_after)  # [H, n]
        forced = self.always_kept(layer.num_tokens, budget).to(scores.device)
        scores[:, forced] = float("inf")
        return scores
