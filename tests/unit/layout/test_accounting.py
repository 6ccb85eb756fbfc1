"""The block accounting rule: what the scheduler frees always leaves enough sub-blocks for the worker."""

from __future__ import annotations

import random

import pytest
from chunk_walk import walk_chunks

from vllm_kvevict.layout.accounting import (
    CHUNK_BUDGET_FLOOR,
    align_budget,
    cdiv,
    plan_request,
    resolve_token_budget,
    with_chunk_budget,
)
from vllm_kvevict.policies.registry import build_policy

NUM_LAYERS = 30


def ragged_split(total: int, heads: int, cap: int, rng: random.Random) -> list[int]:
    """A random split of ``total`` tokens over ``heads`` heads, each <= cap (like Ada-KV's budgets)."""
    weights = [rng.random() ** 3 for _ in range(heads)]
    budgets = [min(cap, int(total * w / sum(weights))) for w in weights]
    for h in rng.sample(range(heads), heads):
        budgets[h] += min(cap - budgets[h], total - sum(budgets))
    assert sum(budgets) == total
    return budgets


def test_align_budget_makes_the_evicted_part_a_whole_number_of_blocks():
    assert align_budget(4096, 512, 128) == 512
    assert align_budget(4000, 512, 128) == 512 + (4000 - 512) % 128
    assert (4000 - align_budget(4000, 512, 128)) % 128 == 0
    assert align_budget(300, 512, 128) == 300


def test_fraction_budget_is_a_fraction_of_the_prompt():
    assert resolve_token_budget(0.25, 4000) == 1000
    assert resolve_token_budget(1024, 4000) == 1024
    with pytest.raises(ValueError, match="1.5"):
        resolve_token_budget(1.5, 4000)


def test_prompt_within_budget_is_untouched():
    plan = plan_request(700, 1024, 128, build_policy("snapkv"), NUM_LAYERS)
    assert not plan.compacts
    assert plan.blocks_to_free == 0
    assert plan.layer_budgets == (700,) * NUM_LAYERS


def test_4k_prompt_with_512_budget_frees_most_blocks():
    plan = plan_request(4096, 512, 128, build_policy("ada-snapkv"), NUM_LAYERS)
    assert plan.compacts
    assert plan.kept_bound == 512
    assert plan.blocks_to_free == (4096 - 512) // 128 - 1
    assert plan.blocks_held(0) == 512 // 128 + 1


@pytest.mark.parametrize("method", ["snapkv", "ada-snapkv"])
def test_a_prompt_whose_plan_would_free_no_block_is_not_compacted(method):
    """640 tokens at 608 per head, blocks of 32: one block to evict, which the rule keeps as headroom."""
    plan = plan_request(640, 608, 32, build_policy(method), NUM_LAYERS)
    assert not plan.compacts
    assert plan.blocks_to_free == 0
    assert plan.layer_budgets == (640,) * NUM_LAYERS
    assert plan_request(672, 608, 32, build_policy(method), NUM_LAYERS).blocks_to_free == 1


def test_short_fractional_budget_never_drops_below_the_window():
    policy = build_policy("snapkv", window=32)
    plan = plan_request(100, 0.1, 32, policy, NUM_LAYERS)
    assert min(plan.layer_budgets) >= 32


METHODS = ["snapkv", "ada-snapkv", "pyramidkv", "critical-ada-snapkv", "streamingllm"]


@pytest.mark.parametrize("method", METHODS)
def test_invariant_enough_sub_blocks_for_every_head_at_every_step(method):
    """Σ_h ceil((B_h + t) / bs) <= H · blocks_held(t) for ragged per-head budgets, every layer and step."""
    rng = random.Random(hash(method) & 0xFFFF)
    policy = build_policy(method)
    for _ in range(150):
        block_size = rng.choice([16, 32, 128])
        heads = rng.choice([1, 3, 8])
        prompt_len = rng.randint(1, 6000)
        budget: int | float = rng.choice([rng.randint(40, 3000), rng.uniform(0.05, 0.9)])
        plan = plan_request(prompt_len, budget, block_size, policy, NUM_LAYERS)
        held_before = cdiv(prompt_len, block_size)
        assert plan.blocks_to_free >= 0
        assert held_before - plan.blocks_to_free >= 1
        if not plan.compacts:
            assert plan.blocks_to_free == 0
            continue
        assert (prompt_len - plan.kept_bound) % block_size == 0
        for layer_budget in set(plan.layer_budgets):
            assert layer_budget <= plan.kept_bound
            per_head = ragged_split(heads * layer_budget, heads, prompt_len, rng)
            for t in (0, 1, block_size - 1, block_size, rng.randint(0, 3000)):
                needed = sum(cdiv(b + t, block_size) for b in per_head)
                assert needed <= heads * plan.blocks_held(t), (prompt_len, budget, block_size, per_head, t)


def test_blocks_held_follows_vllms_per_position_growth():
    plan = plan_request(4096, 512, 128, build_policy("snapkv"), NUM_LAYERS)
    for t in range(0, 600, 7):
        assert plan.blocks_held(t) == cdiv(plan.kept_bound + t, 128) + 1


@pytest.mark.parametrize("method", ["snapkv", "ada-snapkv", "pyramidkv"])
def test_per_chunk_rule_leaves_room_for_every_chunk_and_meets_the_prompt_plan(method):
    """Any chunk sizes: the offset never decreases, stays below O0 = P - B' until the prompt completes and
    equals it then; between chunks a(n) lies in [I, I + bs) once something is evicted; and the blocks held
    while a chunk is computed (after the scheduler freed by the previous chunk) hold a(n0) + chunk entries
    per head, as do those held after it for a(n1)."""
    rng = random.Random(hash(method) & 0xFFFF)
    policy = build_policy(method)
    for _ in range(200):
        bs = rng.choice([16, 32, 128])
        prompt_len = rng.randint(300, 8000)
        budget = rng.randint(40, max(41, prompt_len // 3))
        chunk_budget = rng.choice([1.0, 1.5, 2.0, rng.randint(1, 3000)])
        stride = rng.choice([0, 0, 512, rng.randint(1, 2048)])
        plan = with_chunk_budget(
            plan_request(prompt_len, budget, bs, policy, NUM_LAYERS), chunk_budget, stride
        )
        if not plan.compacts:
            assert plan.chunk_budget == 0 and plan.offset_at(prompt_len - 1) == 0
            continue
        assert plan.chunk_budget >= plan.kept_bound
        for done, offset in walk_chunks(plan, rng):
            assert offset < plan.offset0
            if offset:  # a(n) of the last stride point (of n itself without a stride), plus the rest
                held = plan.kept_length_at(done) - (done % stride if stride else 0)
                assert plan.chunk_budget <= held < plan.chunk_budget + bs


def test_a_multiple_of_b_prime_keeps_at_least_the_floor_between_chunks_and_an_int_is_exact():
    """1k prompt, 10 %: B' = 128 (1024 - 128 is 28 blocks of 32); 1.5 B' = 192 is raised to the floor, so a
    512-token first chunk is not evicted (O(512) = 0) and at 768 computed tokens O = 32 * (256 // 32) = 256.
    An int I = 192 is taken as given: O(512) = 32 * ((512 - 192) // 32) = 320."""
    plan = plan_request(1024, 0.1, 32, build_policy("snapkv"), NUM_LAYERS)
    assert plan.kept_bound == 128
    floored = with_chunk_budget(plan, 1.5)
    assert floored.chunk_budget == CHUNK_BUDGET_FLOOR == 512
    assert floored.offset_at(512) == 0 and floored.offset_at(768) == 256
    exact = with_chunk_budget(plan, 192)
    assert exact.chunk_budget == 192 and exact.offset_at(512) == 320
    large = with_chunk_budget(plan_request(4000, 512, 32, build_policy("snapkv"), NUM_LAYERS), 1.5)
    assert large.chunk_budget == int(1.5 * large.kept_bound) > CHUNK_BUDGET_FLOOR  # the floor does not bind


def test_with_a_stride_the_offset_moves_only_at_its_multiples_whatever_the_chunks():
    """4k prompt, I = 512, stride 512: O(n) is O at the last multiple of 512 below n, so two different
    chunkings (512-token chunks, or ragged ones that stop at every multiple) evict at the same positions."""
    plan = with_chunk_budget(plan_request(4000, 256, 32, build_policy("snapkv"), NUM_LAYERS), 512, 512)
    assert plan.chunk_stride == 512
    for n in range(1, 4000):
        assert plan.offset_at(n) == plan.offset_at(n - n % 512)
    evicted_at = {n for n in range(1, 4000) if plan.chunk_rescores(n - 1, n)}
    assert evicted_at and all(n % 512 == 0 for n in evicted_at)
    ragged = [100, 412, 300, 212, 1, 511, 512, 400, 112, 24]  # never past a multiple (the scheduler clips)
    done, ragged_evictions = 0, set()
    for step in ragged:
        if plan.chunk_rescores(done, done + step):
            ragged_evictions.add(done + step)
        done += step
    assert ragged_evictions == {n for n in evicted_at if n <= done}
