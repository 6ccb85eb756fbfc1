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
from vllm_kvevict.vllm_adapter.evicting_kv_manager import EvictingAttentionManager, register_evicting_spec
from vllm_kvevict.vllm_adapter.kv_spec import EvictingAttentionSpec

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


def _request(prompt_len: int, extra_args: dict | None = None, tag: str = ""):
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id=f"r{prompt_len}-{extra_args}{tag}",
        num_prompt_tokens=prompt_len,
        sampling_params=SimpleNamespace(extra_args=extra_args),
    )


def test_only_requests_that_rewrite_their_blocks_over_time_skip_the_prefix_cache(monkeypatch):
    """Whole-prompt eviction reads the prefix cache and publishes the blocks no compaction writes (the
    leading s blocks it frees); a request evicting between chunks or with a decode-time cap neither reads
    nor publishes; a request kept whole publishes every block as usual."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    published = []
    monkeypatch.setattr(
        FullAttentionManager,
        "cache_blocks",
        lambda self, request, num_tokens, *a, **k: published.append((request, num_tokens)),
    )
    manager, _ = make_manager(budget=256, prefill="whole")
    long_prompt = _request(4000)
    whole = _request(4000, {"kv_eviction": "none"})
    short = _request(200)
    chunked = _request(4000, {"kv_prefill": "chunked"})
    assert not any(manager.skips_prefix_cache(r) for r in (long_prompt, whole, short))
    assert manager.skips_prefix_cache(chunked)
    for r in (long_prompt, whole, short, chunked):
        manager.admit_request(r.request_id, r.sampling_params)
        manager.cache_blocks(r, r.num_prompt_tokens, replay_boundaries=[])
    plan = manager.plan_for(4000)
    assert published == [
        (long_prompt, plan.blocks_to_free * BLOCK_SIZE),
        (whole, 4000),
        (short, 200),
        (chunked, 0),
    ]

    roco = EvictionConfig.from_dict({"method": "roco", "budget": 256})  # implies a decode-time cap
    capped, _ = make_manager(config=roco)
    assert capped.skips_prefix_cache(_request(200))  # kept whole at prefill, but rewritten while generating


def _sharer_on_prefix(manager, pool, prompt: int, shared: int):
    """(owner, sharer, prefix blocks): the owner computed the first ``shared`` tokens itself and stays their
    other holder; the sharer was admitted having found them in the prefix cache and holds the same blocks."""
    owner = _request(prompt, tag="owner")
    manager.admit_request(owner.request_id, owner.sampling_params, 0)
    manager.allocate_new_blocks(owner.request_id, shared, shared)
    prefix = list(manager.req_to_blocks[owner.request_id][: shared // BLOCK_SIZE])
    sharer = _request(prompt, tag="sharer")
    manager.admit_request(sharer.request_id, sharer.sampling_params, shared)
    pool.touch(prefix)  # what vLLM does to a hit: one more holder
    manager.req_to_blocks[sharer.request_id].extend(prefix)
    return owner, sharer, prefix


def test_shared_prefix_stays_and_the_private_part_frees_a_middle_range():
    """A request that found 2048 prompt tokens in the prefix cache owns only the rest: the scheduler plans it
    as a 1952-token prompt and frees blocks [64, 64 + s') once the prompt is processed; the shared blocks are
    never freed by it (their other holder keeps them), and finishing returns what it owned."""
    manager, pool = make_manager(budget=0.25, prefill="whole")
    prompt, shared = 4000, 2048
    c = shared // BLOCK_SIZE
    owner, sharer, prefix = _sharer_on_prefix(manager, pool, prompt, shared)
    free_before = pool.get_num_free_blocks()
    manager.allocate_new_blocks(sharer.request_id, prompt, prompt)
    own = cdiv(prompt, BLOCK_SIZE) - c
    assert pool.get_num_free_blocks() == free_before - own

    private = manager.request_plan(sharer.request_id, prompt)
    assert private == manager.plan_for(prompt - shared) and private.compacts
    manager.remove_skipped_blocks(sharer.request_id, prompt - 1, prompt)  # mid-prompt: nothing
    assert pool.get_num_free_blocks() == free_before - own
    manager.remove_skipped_blocks(sharer.request_id, prompt, prompt)
    blocks = manager.req_to_blocks[sharer.request_id]
    s = private.blocks_to_free
    assert blocks[:c] == prefix and not any(b.is_null for b in blocks[:c])
    assert all(b.is_null for b in blocks[c : c + s])
    assert not any(b.is_null for b in blocks[c + s :])
    assert pool.get_num_free_blocks() == free_before - own + s
    assert all(b.ref_cnt == 2 for b in prefix)

    manager.free(sharer.request_id)
    assert pool.get_num_free_blocks() == free_before
    assert all(b.ref_cnt == 1 for b in prefix)
    assert sharer.request_id not in manager.shared_tokens
    manager.free(owner.request_id)


def test_a_sharer_whose_part_would_free_too_little_keeps_it_and_frees_nothing():
    """``min_freed_share``: the scheduler plans the private part kept whole when compacting it frees less than
    that share of the whole prompt, so it frees no block and holds its prompt as vanilla would."""
    config = EvictionConfig(method="snapkv", budget=0.25, prefill="whole", min_freed_share=0.5)
    manager, pool = make_manager(config=config)
    prompt, shared = 4000, 2048
    owner, sharer, _ = _sharer_on_prefix(manager, pool, prompt, shared)
    manager.allocate_new_blocks(sharer.request_id, prompt, prompt)
    free_after_prompt = pool.get_num_free_blocks()

    compacting = manager.plan_for(prompt - shared)
    assert compacting.compacts and compacting.blocks_to_free * BLOCK_SIZE < 0.5 * prompt
    assert not manager.request_plan(sharer.request_id, prompt).compacts
    manager.remove_skipped_blocks(sharer.request_id, prompt, prompt)
    assert pool.get_num_free_blocks() == free_after_prompt
    assert not any(b.is_null for b in manager.req_to_blocks[sharer.request_id])
    manager.free(sharer.request_id)
    manager.free(owner.request_id)


def test_with_an_fp8_cache_compacting_requests_read_the_prefix_cache_as_with_bf16():
    """An fp8 cache's rows are read back through its scales (``quantised_rows``): a request that compacts
    its whole prompt after the last chunk starts from cached blocks as on a bf16 cache."""
    config = EvictionConfig(method="snapkv", budget=256, prefill="whole")
    quantised, _ = evicting_manager(config, BLOCK_SIZE, NUM_BLOCKS, dtype=torch.uint8)
    for request in (_request(4000), _request(200), _request(4000, {"kv_eviction": "none"})):
        assert not quantised.skips_prefix_cache(request)


def test_a_request_pooling_its_blocks_across_layers_reads_and_publishes_its_frozen_blocks(monkeypatch):
    """``budget_scope: "model"``: a compacting request's kept entries of every layer fill the blocks after its
    freed range, so like a per-layer plan it reads the prefix cache and publishes the blocks its compaction
    frees (never the kept ones); with a threshold (an adaptive plan) it skips the cache and publishes
    nothing."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    from vllm_kvevict.layout.shared_prefix import publishable_tokens

    published = []
    monkeypatch.setattr(
        FullAttentionManager,
        "cache_blocks",
        lambda self, request, num_tokens, *a, **k: published.append((request, num_tokens)),
    )
    pooled = {"budget_scope": "model"}
    for params, reads in ((pooled, True), ({**pooled, "threshold": 0.0}, False)):
        published.clear()
        manager, _ = make_manager(config=EvictionConfig("kvzap", 256, params))
        compacting, whole = _request(4000), _request(4000, {"kv_eviction": "none"})
        assert manager.skips_prefix_cache(compacting) is not reads and not manager.skips_prefix_cache(whole)
        for r in (compacting, whole):
            manager.admit_request(r.request_id, r.sampling_params)
            manager.cache_blocks(r, r.num_prompt_tokens, replay_boundaries=[])
        plan = manager.request_plan(compacting.request_id, 4000)
        frozen = publishable_tokens(plan, 0) if reads else 0
        assert not reads or 0 < frozen == plan.blocks_to_free * plan.block_size < 4000
        assert published == [(compacting, frozen), (whole, 4000)]
