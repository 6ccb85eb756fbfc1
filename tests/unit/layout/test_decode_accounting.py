"""The block rule extended in time: a decode-time cap frees leading blocks as the output grows, and what the
scheduler frees always leaves the worker enough sub-blocks (hand-computed cases, then a property test)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from vllm_kvevict.layout.accounting import cdiv, plan_request, with_decode_cap
from vllm_kvevict.layout.request_plan import NEVER, evicted_offset
from vllm_kvevict.policies.registry import build_policy

NUM_LAYERS = 30


def capped(prompt_len: int, budget: int, cap: int, interval: int | None, block_size: int):
    plan = plan_request(prompt_len, budget, block_size, build_policy("snapkv"), NUM_LAYERS)
    return with_decode_cap(plan, cap, interval)


def test_a_short_prompt_is_first_compacted_when_two_blocks_can_go():
    """P=256 within a 512 prefill budget, cap 512, one 16-token block per re-score: the first re-score is
    at t=288, when 544 tokens per head can lose two whole blocks (offset 32: one freed, one headroom)."""
    plan = capped(256, 512, 512, None, 16)
    assert not plan.compacts and plan.decode_interval == 16
    assert plan.first_rescore == 288
    assert [plan.offset(t) for t in (0, 287, 288, 303, 304)] == [0, 0, 32, 32, 48]
    assert plan.kept_length(287) == 543 and plan.kept_length(288) == 512
    assert plan.kept_length(303) == 512 + 16 - 1 and plan.kept_length(304) == 512
    assert [plan.blocks_freed(t) for t in (287, 288, 304)] == [0, 1, 2]
    assert plan.blocks_held(288) == cdiv(512, 16) + 1
    assert plan.rescores_at(288) and not plan.rescores_at(289) and plan.rescores_at(304)


def test_a_prefill_budget_above_the_cap_is_cut_to_the_cap_at_the_first_decode_token():
    """P=4096, prefill budget 1024 (O0 = 3072), cap 512, interval 32: t=1 drops to 513, then every 32."""
    plan = capped(4096, 1024, 512, 32, 16)
    assert plan.compacts and plan.blocks_to_free == 191 and plan.offset0 == 3072
    assert plan.first_rescore == 1
    assert plan.offset(1) == 3584 and plan.kept_length(1) == 513
    assert plan.blocks_freed(0) == 191 and plan.blocks_freed(1) == 223
    assert plan.kept_length(31) == 512 + 32 - 1 and plan.kept_length(32) == 512
    assert [t for t in range(1, 100) if plan.rescores_at(t)] == [1, 32, 64, 96]


def test_a_prefill_budget_below_the_cap_grows_to_cap_plus_interval_first():
    """P=4096, prefill 256 (O0 = 3840), cap 512, interval 16: the heads grow to 527, re-score at t=272."""
    plan = capped(4096, 256, 512, 16, 16)
    assert plan.first_rescore == 272
    assert plan.kept_length(271) == 527 and plan.kept_length(272) == 512
    assert plan.blocks_freed(271) == plan.blocks_to_free and plan.blocks_freed(272) == plan.blocks_to_free + 1


def test_an_interval_is_rounded_up_to_whole_blocks():
    assert capped(256, 512, 512, 20, 16).decode_interval == 32


def test_without_a_cap_nothing_changes_after_prefill():
    plan = plan_request(4096, 512, 16, build_policy("snapkv"), NUM_LAYERS)
    assert plan.first_rescore == NEVER
    assert all(plan.blocks_freed(t) == plan.blocks_to_free for t in (0, 1, 5000))
    assert plan.kept_length(100) == plan.kept_bound + 100


def test_the_offset_of_numpy_arrays_equals_the_offset_of_each_plan():
    plans = [
        capped(p, b, c, k, 16)
        for p, b, c, k in [
            (256, 512, 512, 16),
            (4096, 1024, 512, 32),
            (900, 128, 256, 64),
            (300, 1000, 5000, 16),
        ]
    ]
    t = np.arange(0, 1500)
    for plan in plans:
        vector = evicted_offset(
            plan.prompt_len, plan.offset0, plan.first_rescore, plan.decode_cap, plan.decode_interval, 16, t
        )
        assert vector.tolist() == [plan.offset(int(x)) for x in t]


@pytest.mark.parametrize("seed", range(4))
def test_what_the_scheduler_keeps_always_fits_what_the_worker_holds(seed):
    """For random prompts, budgets, caps, intervals and block sizes, at every decode step: the blocks held
    cover ceil(a/bs) + 1 (the sub-block bound of a ragged layer holding H·a entries) once compacted, the
    freed blocks never shrink, a re-score lands in [C, C + bs) and a head never exceeds C + k + bs - 1."""
    rng = random.Random(seed)
    for _ in range(40):
        bs = rng.choice([8, 16, 32, 128])
        prompt = rng.randint(1, 5000)
        budget = rng.randint(16, 3000)
        cap = rng.randint(16, 3000)
        plan = capped(prompt, budget, cap, rng.choice([None, bs, 2 * bs, 3 * bs + 1]), bs)
        freed = plan.blocks_freed(0)
        for t in range(0, 2 * cap + 600, 7 if bs > 16 else 3):
            a = plan.kept_length(t)
            if plan.compacted_at(t):
                assert plan.blocks_held(t) >= cdiv(a, bs) + 1
                assert plan.blocks_held(t) == cdiv(a, bs) + 1
            else:
                assert plan.blocks_held(t) == cdiv(prompt + t, bs)
            assert plan.blocks_freed(t) >= freed
            freed = plan.blocks_freed(t)
            if t >= plan.first_rescore:
                assert cap <= a <= cap + plan.decode_interval + bs - 1
            if plan.rescores_at(t):
                assert cap <= a < cap + bs
