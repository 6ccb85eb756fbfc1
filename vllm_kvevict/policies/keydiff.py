"""KeyDiff: keep the keys least like the others, with no queries (Park et al., 2025).

https://arxiv.org/abs/2504.15364
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from vllm_kvevict.policies.key_scored import KeyScoredPolicy


@dataclass
class KeyDiff(KeyScoredPolicy):
    """Score = minus the cosine similarity of a token's key to its head's anchor, the mean of the
    L2-normalised keys of the scored tokens: distinctive keys are kept first. Sinks, window and
    ``span_after`` as in ``KeyScoredPolicy`` (0 / 0 / 0 is the paper's KeyDiff)."""

    def key_scores(self, keys: torch.Tensor) -> torch.Tensor:
        keys = F.normalize(keys, dim=-1)  # [H, n, d]
        anchor = F.normalize(keys.mean(dim=1, keepdim=True), dim=-1)  # [H, 1, d]
        return -(keys * anchor).sum(dim=-1)
