"""The scheduler side under test: an ``EvictingAttentionManager`` over vLLM's real ``BlockPool`` (shared by
the manager tests of prefill, per-chunk and decode-time eviction)."""

from __future__ import annotations

import torch
from vllm.v1.core.block_pool import BlockPool

from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.vllm_adapter.evicting_kv_manager import EvictingAttentionManager
from vllm_kvevict.vllm_adapter.kv_spec import EvictingAttentionSpec


def evicting_manager(
    config: EvictionConfig,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype = torch.bfloat16,
    enable_caching: bool = False,
    spare_columns: int = 0,
) -> tuple[EvictingAttentionManager, BlockPool]:
    """A manager for the bundled model's shapes (30 layers, 3 KV heads of 64) over ``num_blocks`` blocks
    (``dtype``: the cache's, torch.uint8 for an fp8 cache; ``enable_caching``: vLLM's prefix cache on;
    ``spare_columns``: the spec's columns for spare blocks)."""
    spec = EvictingAttentionSpec(
        block_size=block_size,
        num_kv_heads=3,
        head_size=64,
        dtype=dtype,
        eviction=config,
        num_model_layers=30,
        spare_columns=spare_columns,
    )
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=enable_caching, hash_block_size=block_size)
    manager = EvictingAttentionManager(
        spec,
        block_pool=pool,
        enable_caching=enable_caching,
        kv_cache_group_id=0,
        scheduler_block_size=block_size,
    )
    return manager, pool
