"""Applying a policy to every layer of a captured prompt."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens, LayerKV


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
