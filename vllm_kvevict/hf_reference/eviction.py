"""Applying a policy to every layer of a captured prompt."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_kvevict.datapath.pooled_eviction import kept_across_layers
from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens, LayerKV, ScoredPolicy


def kvpress_kept_count(num_tokens: int, kept_fraction: float) -> int:
    """Per-head kept tokens for a kept fraction, computed as kvpress does for ``compression_ratio =
    1 - kept_fraction``: ``max(1, int(n * (1 - ratio)))`` (the float rounding of 1 - ratio included)."""
    ratio = 1.0 - kept_fraction
    return max(1, int(num_tokens * (1 - ratio)))


def kept_per_layer(policy: EvictionPolicy, layers: Sequence[LayerKV], budget: int) -> list[KeptTokens]:
    """``policy.select`` on every layer with its ``layer_budget`` for the request's per-head ``budget``."""
    kept = []
    for layer in layers:
        layer_budget = policy.layer_budget(budget, layer.num_tokens, layer.layer_idx, layer.num_layers)
        kept.append(policy.select(layer, layer_budget))
    return kept


def kept_ranked_across_layers(
    policy: ScoredPolicy, layers: Sequence[LayerKV], layer_budgets: Sequence[int], unit: int = 1
) -> list[KeptTokens]:
    """What a request whose budget is pooled across layers keeps (``budget_scope: "model"``): every layer's
    scores [H, n] ranked together, ``H · Σ layer_budgets`` kept (``pooled_eviction.kept_across_layers``;
    ``unit``: every (layer, head) count in whole sub-blocks, as a kept context's creator)."""
    pairs = zip(layers, layer_budgets, strict=True)
    scores = [policy.score(layer, budget).float() for layer, budget in pairs]
    heads, length = layers[0].num_kv_heads, layers[0].num_tokens
    return kept_across_layers(scores, tuple(layer_budgets), heads, length, unit)
