"""CriticalKV: two-stage selection weighting attention by the projected value norm (Feng et al., 2025).

https://arxiv.org/abs/2502.03805
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kvevict.policies.adakv import AdaKV
from vllm_kvevict.policies.attention_scores import value_norms
from vllm_kvevict.policies.base import KeptTokens, LayerKV, ScoredPolicy, WrappingPolicy, check_fraction
from vllm_kvevict.policies.kept_masks import critical_selection


@dataclass
class CriticalKV(WrappingPolicy):
    """Wraps a scorer (``CriticalKV(SnapKV())``) or Ada-KV (``CriticalKV(AdaKV(SnapKV()))``).

    Per head with budget B_h (uniform, or Ada-KV's allocation): the first ``first_stage_ratio * B_h``
    tokens by plain attention score, the rest by ``(score + epsilon) * ||V W_O||_1`` among the others.
    Matches kvpress's CriticalKVPress (at least one stage-1 token) and CriticalAdaKVPress (whose Ada
    safeguard tokens are always kept, so stage 1 is at least the safeguard there).
    Needs ``LayerKV.o_proj``.
    """

    #: the registry asks this: the worker collects the o_proj weights only for a method that reads them.
    needs_o_proj: ClassVar[bool] = True

    inner: ScoredPolicy | AdaKV
    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if not isinstance(self.inner, ScoredPolicy | AdaKV):
            raise ValueError(f"{owner} wraps a ScoredPolicy or an AdaKV; got {self.inner!r}")
        check_fraction(owner, "first_stage_ratio", self.first_stage_ratio, 0.0, 1.0)
        check_fraction(owner, "epsilon", self.epsilon, 0.0, float("inf"))

    def select(self, layer: LayerKV, budget: int) -> KeptTokens:
        if (everything := self.keep_all_or_check(layer, budget)) is not None:
            return everything
        if layer.o_proj is None:
            raise ValueError(f"{self._label()} needs LayerKV.o_proj (the layer's o_proj weight); got None")
        if isinstance(self.inner, AdaKV):
            scores, ada_keep = self.inner.keep_mask(layer, budget)
            budgets = ada_keep.sum(dim=1)
            floor: int = self.inner.safeguard(budget)
        else:
            scores = self.inner.score(layer, budget)
            budgets = torch.full((layer.num_kv_heads,), budget, dtype=torch.int64, device=scores.device)
            floor = 1 if self.first_stage_ratio > 0 else 0
        norms = value_norms(layer.value_rows(self._label()), layer.o_proj)
        keep = critical_selection(scores, norms, budgets, self.first_stage_ratio, self.epsilon, floor)
        return KeptTokens.from_mask(keep)
