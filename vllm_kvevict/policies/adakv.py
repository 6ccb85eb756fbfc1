"""Ada-KV: head-wise adaptive budgets around any scorer (Feng et al., 2024).

https://arxiv.org/abs/2407.11550
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kvevict.policies.base import (
    EvictionPolicy,
    KeptTokens,
    LayerKV,
    ScoredPolicy,
    WrappingPolicy,
    after_prefix,
    check_choice,
    check_fraction,
    check_int,
    keeps_equal_counts,
    shifted,
)
from vllm_kvevict.policies.kept_masks import (
    ada_allocation,
    ada_blend_allocation,
    safeguard_size,
    whole_unit_mask,
)

#: How ``alpha`` is read: kvpress's and the paper code's safeguard, or the blend of the paper's formula.
ALLOCATIONS: tuple[str, ...] = ("safeguard", "blend")


@dataclass
class AdaKV(WrappingPolicy):
    """Wraps a ScoredPolicy (``AdaKV(SnapKV())``, ``AdaKV(PyramidKV())``): the layer's ``H * budget`` slots
    go to the best scores of all KV heads together, after each head keeps its top ``alpha * budget``
    (the safeguard). Heads end up with ragged budgets B_h, summing to ``H * budget`` exactly.

    ``allocation="safeguard"`` (default, kvpress parity): ``alpha`` is kvpress's ``alpha_safeguard`` (0.2),
    the guaranteed fraction per head. ``allocation="blend"``: ``alpha`` is the adaptive share of each head's
    budget, ``B_h = alpha * B_h* + (1 - alpha) * B`` (``ada_blend_allocation``), so no head falls below
    ``(1 - alpha) * B``.

    ``head_unit`` > 1 (set by ``kept_context_form``, never by a user): every head's budget is then moved to
    a multiple of it with the same layer total (``kept_masks.whole_unit_counts``), so a kept context's
    heads fill whole sub-blocks.
    """

    reads_own_values: ClassVar[bool] = False

    inner: ScoredPolicy
    alpha: float = 0.2
    allocation: str = "safeguard"
    head_unit: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.inner, ScoredPolicy):
            raise ValueError(f"AdaKV wraps a ScoredPolicy (SnapKV, PyramidKV, ...); got {self.inner!r}")
        check_fraction(type(self).__name__, "alpha", self.alpha, 0.0, 1.0)
        check_choice(type(self).__name__, "allocation", self.allocation, ALLOCATIONS)
        check_int(type(self).__name__, "head_unit", self.head_unit, 1)

    def kept_context_form(self, block_size: int) -> EvictionPolicy | None:
        """Head budgets in whole ``block_size`` sub-blocks, around an inner method with one budget per layer
        (not PyramidKV's per-layer ones)."""
        if not keeps_equal_counts(self.inner):
            return None
        form = dataclasses.replace(self, head_unit=block_size)
        form.name = self.name
        return form

    def keep_mask(self, layer: LayerKV, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores [kv_heads, n], keep [kv_heads, n] bool) for ``budget`` < n."""
        scores = self.inner.score(layer, budget)
        if self.allocation == "blend":
            keep = ada_blend_allocation(scores, budget, self.alpha)
        else:
            keep = ada_allocation(scores, budget, self.alpha)
        if self.head_unit > 1:
            keep = whole_unit_mask(scores, keep, self.head_unit)
        return scores, keep

    def safeguard(self, budget: int) -> int:
        """Tokens every head keeps by its own scores before the shared allocation (none in the blend,
        which has no shared stage)."""
        if self.allocation == "blend":
            return 0
        return safeguard_size(budget, self.alpha)

    def select(self, layer: LayerKV, budget: int) -> KeptTokens:
        if (everything := self.keep_all_or_check(layer, budget)) is not None:
            return everything
        return KeptTokens.from_mask(self.keep_mask(layer, budget)[1])

    def select_after(self, layer: LayerKV, budget: int, fixed: int) -> KeptTokens:
        """The inner scores of the whole layer (the prefix in the softmax); the layer's ``H * budget`` slots
        shared among the heads' tokens after it."""
        if fixed <= 0:
            return self.select(layer, budget)
        if self.head_unit > 1:
            raise ValueError(f"{self._label()}: a kept context's form never reads a shared prefix")
        if (everything := self.keep_all_or_check(after_prefix(layer, fixed), budget)) is not None:
            return shifted(everything, fixed)
        scores = self.inner.score(layer, budget)[:, fixed:]
        if self.allocation == "blend":
            keep = ada_blend_allocation(scores, budget, self.alpha)
        else:
            keep = ada_allocation(scores, budget, self.alpha)
        return shifted(KeptTokens.from_mask(keep), fixed)
