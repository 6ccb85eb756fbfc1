"""Scheduler side: the evicting manager frees exactly the leading blocks of the accounting rule, with
vLLM's real BlockPool, and a finished request returns everything."""

from __future__ import annotations

import pytest
import torch
from evicting_manager import evicting_manager
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from vllm_kvevict.layout.accounting import CHUNK_BUDGET_FLOOR, cdiv
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.vllm_adapter.kv_spec import (
    EvictingAttentionManager,
    EvictingAttentionSpec,
    register_evicting_spec,
)

BLOCK_SIZE = 32
NUM_BLOCKS = 400


def make_manager(
    method: str = "snapkv",
    budget: int | float = 256,
    prefill: str = "chunked",
    config: EvictionConfig | None = None,
) -> tuple[EvictingAttentionManager, BlockPool]:
    config = config or EvictionConfig(method=method, budget=budget, prefill=prefill)
    return evicting_manager(config, BLOCK_SIZE, NUM_BLOCKS)


def test_registered_with_its_manager_next_to_the_built_ins():
    register_evicting_spec()
    spec = EvictingAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16, eviction="{}"
    )
    assert KVCacheSpecRegistry.get_manager_class(spec) is EvictingAttentionManager
    plain = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    assert KVCacheSpecRegistry.get_manager_class(plain) is not EvictingAttentionManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(spec) is FullAttentionSpec


def test_merge_keeps_the_eviction_setting():
    spec = EvictingAttentionSpec(
        block_size=16,
        num_kv_heads=3,
        head_size=64,
        dtype=torch.float16,
        eviction='{"x": 1}',
        num_model_layers=4,
    )
    merged = EvictingAttentionSpec.merge([spec, spec])
    assert merged == spec


@pytest.mark.parametrize("prompt_len", [1000, 4096, 4097])
def test_frees_leading_blocks_once_prompt_is_processed(prompt_len):
    manager, pool = make_manager(budget=256, prefill="whole")
    free_at_start = pool.get_num_free_blocks()
    manager.allocate_new_blocks("r", prompt_len, prompt_len)
    held = cdiv(prompt_len, BLOCK_SIZE)
    assert pool.get_num_free_blocks() == free_at_start - held

    # Mid-prompt (not yet processed): nothing is freed.
    manager.remove_skipped_blocks("r", prompt_len - 1, prompt_len)
    assert pool.get_num_free_blocks() == free_at_start - held

    plan = manager.plan_for(prompt_len)
    assert plan.compacts and plan.blocks_to_free > 0
    manager.remove_skipped_blocks("r", prompt_len, prompt_len)
    assert pool.get_num_free_blocks() == free_at_start - held + plan.blocks_to_free
    blocks = manager.req_to_blocks["r"]
    assert all(b.is_null for b in blocks[: plan.blocks_to_free])
    assert not any(b.is_null for b in blocks[plan.blocks_to_free :])

    # Idempotent on later steps; decode growth then allocates per position as usual.
    manager.remove_skipped_blocks("r", prompt_len + 5, prompt_len)
    assert pool.get_num_free_blocks() == free_at_start - held + plan.blocks_to_free
    manager.allocate_new_blocks("r", prompt_len + 300, prompt_len + 300)
    held_now = sum(not b.is_null for b in manager.req_to_blocks["r"])
    assert held_now == plan.blocks_held(300)

    manager.free("r")
    assert pool.get_num_free_blocks() == free_at_start


def test_chunked_prompt_frees_blocks_after_each_chunk():
    """512-token chunks of a 4000-token prompt: after each chunk the request holds a(n) = n - O(n) entries
    per head in [I, I + bs), and the pool gets back exactly the blocks the rule frees."""
    manager, pool = make_manager(budget=256)
    plan = manager.plan_for(4000)
    assert plan.chunk_budget == max(int(1.5 * plan.kept_bound), CHUNK_BUDGET_FLOOR)
    free_at_start = pool.get_num_free_blocks()
    peak = 0
    for end in [*range(512, 4000, 512), 4000]:
        manager.remove_skipped_blocks("r", end - 512 if end < 4000 else 3584, 4000)
        manager.allocate_new_blocks("r", end, end)
        peak = max(peak, free_at_start - pool.get_num_free_blocks())
        manager.remove_skipped_blocks("r", end, 4000)
        held = free_at_start - pool.get_num_free_blocks()
        assert held == cdiv(end, BLOCK_SIZE) - plan.blocks_freed_at(end)
        if end < 4000 and end - plan.chunk_budget >= 2 * BLOCK_SIZE:
            assert plan.chunk_budget <= plan.kept_length_at(end) < plan.chunk_budget + BLOCK_SIZE
    assert held == plan.blocks_held(0)
    # never more than I + bs + one chunk (+ one block of headroom) at once
    assert peak <= cdiv(plan.chunk_budget + BLOCK_SIZE + 512, BLOCK_SIZE) + 1
    manager.free("r")
    assert pool.get_num_free_blocks() == free_at_start


def test_short_prompt_keeps_all_blocks():
    manager, pool = make_manager(budget=1024)
    free_at_start = pool.get_num_free_blocks()
    manager.allocate_new_blocks("r", 500, 500)
    manager.remove_skipped_blocks("r", 500, 500)
    assert pool.get_num_free_blocks() == free_at_start - cdiv(500, BLOCK_SIZE)
    manager.free("r")
    assert pool.get_num_free_blocks() == free_at_start


def test_requests_that_evict_neither_read_nor_publish_prefix_cache_blocks(monkeypatch):
    """A compacting request (server setting, or its own budget) and a decode-capped one skip the prefix
    cache; a request within budget or with ``kv_eviction: none`` publishes its blocks as usual."""
    from types import SimpleNamespace

    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    published = []
    monkeypatch.setattr(
        FullAttentionManager, "cache_blocks", lambda self, request, *a, **k: published.append(request)
    )
    manager, _ = make_manager(budget=256)

    def request(prompt_len: int, extra_args: dict | None = None):
        return SimpleNamespace(
            request_id=f"r{prompt_len}-{extra_args}",
            num_prompt_tokens=prompt_len,
            sampling_params=SimpleNamespace(extra_args=extra_args),
        )

    long_prompt = request(4000)
    whole = request(4000, {"kv_eviction": "none"})
    short = request(200)
    own_budget = request(600, {"kv_budget": 64})
    assert manager.evicts(long_prompt) and manager.evicts(own_budget)
    assert not manager.evicts(whole) and not manager.evicts(short)
    for r in (long_prompt, whole, short, own_budget):
        manager.cache_blocks(r, r.num_prompt_tokens, replay_boundaries=[])
    assert published == [whole, short]

    roco = EvictionConfig.from_dict({"method": "roco", "budget": 256})  # implies a decode-time cap
    capped, _ = make_manager(config=roco)
    assert capped.evicts(request(200))  # kept whole at prefill, but rewritten while generating
