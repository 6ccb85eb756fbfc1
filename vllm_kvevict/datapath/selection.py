"""Kept selection, the same for the three eviction modes: the policy's choice through the guard, or the one
fallback (each head's newest entries) when the policy fails. The scheduler frees the request's blocks
whatever happens here, so a failing policy must still leave a selection that fits the accounting."""

from __future__ import annotations

import logging

import torch

from vllm_kvevict import metrics
from vllm_kvevict.datapath.policy_guard import PolicyFault, guarded_select
from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens, LayerKV

logger = logging.getLogger("vllm.kvevict.selection")


def select_kept(
    policy: EvictionPolicy, layer: LayerKV, budget: int, req_id: str, uniform: bool = False, shared: int = 0
) -> KeptTokens:
    """The entries ``policy`` keeps of ``layer`` (exactly H x ``budget``; ``uniform``: ``budget`` in every
    head, the rule between chunks), or each head's newest ``budget`` entries when it fails (logged and
    counted in ``vllm_kvevict_policy_fallbacks_total``). ``shared``: entries ``[0, shared)`` are a prefix
    other requests share, in view of the scores but never chosen (the caller keeps them)."""
    try:
        kept = guarded_select(policy, layer, budget, shared)  # any policy failure -> a counted PolicyFault
        if not uniform or bool((kept.counts == budget).all()):
            return kept
        problem = f"kept {kept.counts.tolist()} entries per head between chunks, needs {budget} each"
        metrics.record_policy_fallback(policy.name or type(policy).__name__, "wrong_counts")
    except PolicyFault as exc:
        problem = str(exc)
    log_fallback(policy.name, req_id, layer.layer_idx, problem, budget)
    valid = torch.ones(layer.num_kv_heads, layer.num_tokens, dtype=torch.bool, device=layer.keys.device)
    valid[:, :shared] = False
    return newest_entries(valid, budget)


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
