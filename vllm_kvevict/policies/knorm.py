"""K-norm: keep the keys with the smallest L2 norm, with no queries (Devoto et al., 2024).

https://arxiv.org/abs/2406.11430
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.key_scored import KeyScoredPolicy


@dataclass
class KNorm(KeyScoredPolicy):
    """Score = minus the key's L2 norm: keys with a small norm draw the most attention, so they are kept
    first. Sinks, window and ``span_after`` as in ``KeyScoredPolicy`` (0 / 0 / 0 is the paper's rule and
    kvpress's ``KnormPress``)."""

    def key_scores(self, keys: torch.Tensor) -> torch.Tensor:
        return -torch.linalg.vector_norm(keys, dim=-1)  # [H, n]
