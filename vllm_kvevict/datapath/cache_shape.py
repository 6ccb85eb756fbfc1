"""The model's eviction geometry, the one every mode and table of the datapath shares."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheShape:
    """The model's eviction geometry: layers, KV heads per layer, tokens per block."""

    num_layers: int
    num_kv_heads: int
    block_size: int
