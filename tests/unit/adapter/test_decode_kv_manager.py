"""Scheduler side of the decode-time cap: as the output grows the manager frees the leading blocks of the
rule, so a request holds ceil(a(t)/bs) + 1 blocks at every step, with vLLM's real BlockPool."""

from __future__ import annotations

from evicting_manager import evicting_manager
from vllm.v1.core.block_pool import BlockPool

from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.vllm_adapter.evicting_kv_manager import EvictingAttentionManager

BLOCK_SIZE = 16
NUM_BLOCKS = 600


def make_manager(config: EvictionConfig) -> tuple[EvictingAttentionManager, BlockPool]:
    return evicting_manager(config, BLOCK_SIZE, NUM_BLOCKS)


def decode(manager: EvictingAttentionManager, prompt_len: int, steps: int) -> list[int]:
    """Blocks held after each decode step, scheduled like vLLM does: free on the processed tokens, then
    allocate room for the next token."""
    manager.allocate_new_blocks("r", prompt_len, prompt_len)
    held = []
    for t in range(steps):
        manager.remove_skipped_blocks("r", prompt_len + t, prompt_len)
        manager.allocate_new_blocks("r", prompt_len + t + 1, prompt_len + t + 1)
        held.append(sum(not block.is_null for block in manager.req_to_blocks["r"]))
    return held


def test_roco_alone_holds_a_256_token_prompt_at_its_512_cap_for_4000_tokens():
    """``--kv-eviction roco --kv-budget 512``: the prompt stays whole, the output is capped at 512."""
    manager, pool = make_manager(EvictionConfig.from_dict({"method": "roco", "budget": 512}))
    free_at_start = pool.get_num_free_blocks()
    held = decode(manager, 256, 4000)
    assert max(held) == cdiv(512 + 16, BLOCK_SIZE) + 1  # 34 blocks; vanilla ends at 266
    assert held[:287] == [cdiv(256 + t + 1, BLOCK_SIZE) for t in range(287)]  # whole until t1 = 288
    assert held[-1] <= 34
    manager.free("r")
    assert pool.get_num_free_blocks() == free_at_start


def test_a_prefill_budget_composes_with_a_larger_decode_cap():
    config = EvictionConfig.from_dict(
        {"method": "snapkv", "budget": 256, "decode": {"method": "roco", "budget": 1024, "interval": 32}}
    )
    manager, _ = make_manager(config)
    held = decode(manager, 4096, 2000)
    plan = manager.request_plan("r", 4096)
    # Freed on the processed tokens (t), allocated one token ahead (t + 1), as vLLM schedules.
    assert held == [cdiv(4096 + t + 1, BLOCK_SIZE) - plan.blocks_freed(t) for t in range(2000)]
    assert held[0] == cdiv(256 + 1, BLOCK_SIZE) + 1
    assert max(held) == cdiv(1024 + 32, BLOCK_SIZE) + 1


def test_a_per_request_decode_budget_is_the_one_its_blocks_follow():
    config = EvictionConfig.from_dict({"method": "h2o", "budget": 512})
    manager, _ = make_manager(config)
    manager.admit_request("r", type("Params", (), {"extra_args": {"kv_decode_budget": 128}})())
    held = decode(manager, 256, 1000)
    assert max(held[400:]) == cdiv(128 + 16, BLOCK_SIZE) + 1
