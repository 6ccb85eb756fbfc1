"""Kept selection, the same for the three eviction modes: a mode's choice (its policy, budget and inputs)
through the one guard, or the one fallback (each head's newest entries) when the policy fails. The scheduler
frees the request's blocks whatever happens here, so a failing policy must still leave a selection that fits
the accounting."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_kvevict.datapath.policy_guard import (
    PolicyFault,
    fault,
    guarded_scores,
    guarded_select,
    policy_label,
)
from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens, LayerKV, ScoredPolicy

logger = logging.getLogger("vllm.kvevict.selection")


class LayerChoice(Protocol):
    """How one mode chooses a layer's kept entries: ``budget`` entries per head (on average; ``exact``: the
    guard holds the layer to exactly H x budget), never one of the first ``shared`` held entries. Ranked
    across layers, it gives its scores instead (``scores``), and ``head_unit`` > 1 keeps every head's count
    a multiple of it (a kept context in whole sub-blocks)."""

    policy: object
    budget: int
    exact: bool
    shared: int

    def choose(self) -> KeptTokens:
        """Indices [H, M] (-1 padded) into the held entries and counts [H]; raises ``PolicyFault``."""
        ...

    def scores(self, req_id: str) -> torch.Tensor | None:
        """Guarded scores [H, n] float32 of the last n judged entries (``+inf``: always kept, ``-inf``:
        never), or None when the policy failed (logged and counted: every layer keeps its newest)."""
        ...

    @property
    def head_unit(self) -> int: ...

    def rejected(self) -> None:
        """The choice failed and the fallback keeps the layer (a stateful policy forgets its state)."""
        ...


@dataclass
class PrefillChoice:
    """A prefill policy's choice over ``layer`` (the held prompt entries), exactly H x ``budget``;
    ``uniform``: ``budget`` in every head (the rule between chunks). Ranked across layers: ``own_rows``,
    each entry scored by its own cache row, and ``forced`` [H, n] bool, entries always kept by position."""

    policy: EvictionPolicy
    layer: LayerKV
    budget: int
    shared: int = 0
    uniform: bool = False
    exact: bool = True
    own_rows: bool = False
    forced: torch.Tensor | None = None

    @property
    def head_unit(self) -> int:
        return int(getattr(self.policy, "head_unit", 1))

    def scores(self, req_id: str) -> torch.Tensor | None:
        assert isinstance(self.policy, ScoredPolicy), "only a scoring policy is ranked across layers"
        scores = scores_or_fallback(self.policy, self.layer, self.budget, req_id, self.own_rows)
        if scores is not None and self.forced is not None:
            scores = torch.where(self.forced, float("inf"), scores)
        return scores

    def choose(self) -> KeptTokens:
        kept = guarded_select(self.policy, self.layer, self.budget, self.shared)
        if self.uniform and not bool((kept.counts == self.budget).all()):
            problem = f"kept {kept.counts.tolist()} entries per head between chunks, needs {self.budget} each"
            raise fault(self.policy, "wrong_counts", problem)
        return kept

    def rejected(self) -> None:
        return None


def kept_or_newest(choice: LayerChoice, valid: torch.Tensor, req_id: str, layer_idx: int) -> KeptTokens:
    """``choice.choose()``, or each head's newest ``choice.budget`` entries of ``valid`` [H, L] bool
    (False: padding or a shared prefix) when it fails (logged and counted in
    ``vllm_kvevict_policy_fallbacks_total``)."""
    try:
        return choice.choose()
    except PolicyFault as exc:
        problem = str(exc)
    log_fallback(policy_label(choice.policy), req_id, layer_idx, problem, choice.budget)
    choice.rejected()
    return newest_entries(valid, choice.budget)


def select_kept(
    policy: EvictionPolicy, layer: LayerKV, budget: int, req_id: str, uniform: bool = False, shared: int = 0
) -> KeptTokens:
    """The entries ``policy`` keeps of ``layer`` (exactly H x ``budget``; ``uniform``: ``budget`` in every
    head, the rule between chunks), or each head's newest ``budget`` entries when it fails. ``shared``:
    entries ``[0, shared)`` are a prefix other requests share, in view of the scores but never chosen (the
    caller keeps them)."""
    valid = torch.ones(layer.num_kv_heads, layer.num_tokens, dtype=torch.bool, device=layer.keys.device)
    valid[:, :shared] = False
    choice = PrefillChoice(policy, layer, budget, shared, uniform)
    return kept_or_newest(choice, valid, req_id, layer.layer_idx)


def scores_or_fallback(
    policy: ScoredPolicy, layer: LayerKV, budget: int, req_id: str, own_rows: bool = False
) -> torch.Tensor | None:
    """The guarded scores [H, n] float32 of one layer of a request whose budget is pooled across layers
    (``guarded_scores``), those at or below the policy's floor (``kept_score_floor``: a threshold) as ``-inf``
    (never kept), or None when the policy failed (logged and counted; the ranking then keeps each layer's
    newest entries)."""
    try:
        scores = guarded_scores(policy, layer, budget, own_rows).float()
    except PolicyFault as exc:
        log_fallback(policy_label(policy), req_id, layer.layer_idx, str(exc), budget)
        return None
    floor = policy.kept_score_floor(layer)
    if floor is not None:
        scores = torch.where(scores > floor, scores, float("-inf"))
    return scores


def newest_entries(valid: torch.Tensor, budget: int) -> KeptTokens:
    """Each head's newest ``budget`` held entries. valid [H, L] bool (False: padding) -> indices [H, M]
    ascending, -1 padded, and counts [H] int64."""
    width = valid.shape[1]
    rank = valid.flip(1).cumsum(1).flip(1)  # 1 for the newest held entry, 2 for the one before, ...
    keep = valid & (rank <= budget)
    columns = torch.arange(width, device=valid.device).expand_as(valid)
    ordered = torch.where(keep, columns, width).sort(dim=1).values[:, : max(1, min(budget, width))]
    return KeptTokens(indices=torch.where(ordered == width, -1, ordered), counts=keep.sum(dim=1))


def log_fallback(method: str, req_id: str, layer_idx: int, problem: str, budget: int) -> None:
    logger.error(
        "policy %r failed on request %s layer %d (%s); keeping each head's newest %d entries",
        method,
        req_id,
        layer_idx,
        problem,
        budget,
    )
