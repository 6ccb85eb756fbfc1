"""An fp8 KV cache counted in bytes (``vllm_adapter/cache_bytes.py``, ``metrics``): a block of an fp8 cache
weighs half a bf16 one, the start-up line says what that multiplies eviction's gain by, and the saved-bytes
gauge counts blocks in the cache's own bytes."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_kvevict.layout.accounting import plan_request
from vllm_kvevict.metrics import EvictionMetrics
from vllm_kvevict.policies import build_policy
from vllm_kvevict.vllm_adapter.cache_bytes import block_bytes, cache_bytes_clause

LAYERS, HEADS, DIM, BS = 30, 3, 64, 32  # the bundled model's shapes


def spec(dtype: torch.dtype) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=dtype)


def test_an_fp8_block_weighs_half_a_bf16_block():
    fp8, bf16 = spec(torch.uint8), spec(torch.bfloat16)  # vLLM stores fp8 caches as uint8
    assert block_bytes(fp8.page_size_bytes, LAYERS) == LAYERS * 2 * BS * HEADS * DIM  # K and V, 1 byte each
    assert 2 * block_bytes(fp8.page_size_bytes, LAYERS) == block_bytes(bf16.page_size_bytes, LAYERS)


def test_the_start_up_clause_multiplies_evictions_gain_by_the_element_ratio():
    plan = plan_request(4096, 1024, BS, build_policy("snapkv"), LAYERS)
    gain = 128 / plan.blocks_held(0)
    bf16_bytes = block_bytes(spec(torch.bfloat16).page_size_bytes, LAYERS)
    fp8_bytes = block_bytes(spec(torch.uint8).page_size_bytes, LAYERS)
    assert (
        cache_bytes_clause(plan, bf16_bytes, torch.bfloat16)
        == f"; a {BS}-token block is 720 KiB over all layers"
    )
    quantised = cache_bytes_clause(plan, fp8_bytes, torch.uint8)
    assert quantised.startswith(f"; a {BS}-token block is 360 KiB over all layers (1-byte fp8 elements")
    assert f"holds 2x the blocks of a 16-bit cache, about {2 * gain:.1f}x such requests" in quantised
    assert "x such requests" not in cache_bytes_clause(plan, 2 * bf16_bytes, torch.float32)


@pytest.mark.parametrize(("dtype", "per_block"), [(torch.uint8, 368_640), (torch.bfloat16, 737_280)])
def test_the_saved_bytes_gauge_counts_blocks_in_the_caches_own_bytes(dtype, per_block):
    registry = CollectorRegistry()
    metrics = EvictionMetrics(registry)
    assert block_bytes(spec(dtype).page_size_bytes, LAYERS) == per_block
    metrics.set_kv_cache_saved(saved_blocks=120, total_blocks=480, block_bytes=per_block)
    assert registry.get_sample_value("vllm_kvevict_kv_blocks_saved") == 120
    assert registry.get_sample_value("vllm_kvevict_kv_bytes_saved") == 120 * per_block
    assert registry.get_sample_value("vllm_kvevict_kv_cache_saved_perc") == 0.25
