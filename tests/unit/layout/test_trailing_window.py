"""FastKVzip's trailing-window rule: its arithmetic, and the block accounting that follows it."""

from __future__ import annotations

import random

import pytest
from chunk_walk import walk_chunks

from vllm_kvevict.layout.accounting import plan_request, with_chunk_budget
from vllm_kvevict.layout.shared_prefix import reads_prefix_cache
from vllm_kvevict.layout.trailing_window import trailing_window_held, trailing_window_ratio
from vllm_kvevict.policies.registry import build_policy

NUM_LAYERS = 30


def test_trailing_window_ratio_keeps_the_prompt_at_its_budget_with_the_window_whole() -> None:
    # r = 10 % of L = 4,000 with w = 200: (400 - 200) / 3,800 of the first 3,800 tokens, then all 200.
    ratio = trailing_window_ratio(400, 4000, 200)
    assert ratio == pytest.approx(200 / 3800)
    assert ratio * 3800 + 200 == pytest.approx(400)
    assert trailing_window_ratio(100, 4000, 200) == 0.0  # the window is cut to the budget
    assert trailing_window_ratio(400, 4000, 0) == pytest.approx(0.1)


def test_trailing_window_held_counts_compressed_then_protected_entries() -> None:
    L, B, w = 4000, 400, 200
    assert trailing_window_held(512, L, B, w) == (int(512 * 200 / 3800), 0)
    assert trailing_window_held(3800, L, B, w) == (200, 0)
    assert trailing_window_held(3900, L, B, w) == (200 + 100, 100)  # half the window has arrived
    assert trailing_window_held(4000, L, B, w) == (400, 200)  # the final budget, window whole
    assert trailing_window_held(512, L, B, w, floor=36) == (36, 0)  # what the scorer always keeps
    assert trailing_window_held(20, L, B, w, floor=36) == (20, 0)  # fewer arrived than the floor
    with pytest.raises(ValueError, match="window=-1 is not valid"):
        trailing_window_held(10, L, B, -1)


@pytest.mark.parametrize("method", ["snapkv", "ada-snapkv", "pyramidkv"])
def test_trailing_plan_holds_the_window_whole_and_leaves_room_for_every_chunk(method):
    """Any chunk sizes and strides: the offset never decreases and stays at most O0 before the prompt
    completes (equal to it then); once something is evicted a(n) lies in [h(n), h(n) + bs) with h(n) the
    rule's count (the arrived window among it, the rest at least the floor); the blocks held while a chunk
    is computed hold a(n0) + chunk entries per head."""
    rng = random.Random(hash(method) & 0xFFFF)
    policy = build_policy(method)
    checked = 0
    for _ in range(200):
        bs = rng.choice([16, 32, 128])
        prompt_len = rng.randint(300, 8000)
        budget = rng.randint(40, max(41, prompt_len // 3))
        window = rng.choice([1, 32, 128, 256, rng.randint(1, 1000)])
        floor = rng.choice([0, 36, 64])
        stride = rng.choice([0, 0, 512, rng.randint(1, 2048)])
        base = plan_request(prompt_len, budget, bs, policy, NUM_LAYERS)
        plan = with_chunk_budget(base, 1.5, stride, window, floor)
        if not plan.compacts:
            continue
        assert plan.trailing_window == min(window, plan.kept_bound)
        assert plan.evicts_between_chunks and plan.chunk_budget == 0  # the window, not I, decides
        assert not reads_prefix_cache(plan)  # it rewrites its blocks between chunks
        for done, offset in walk_chunks(plan, rng):
            if offset and done == done - (done % stride if stride else 0):  # at a stride point
                held, protected = plan.trailing_held(done)
                assert held <= plan.kept_length_at(done) < held + bs
                assert protected == max(0, done - (prompt_len - plan.trailing_window))
                assert held - protected >= min(floor, done - protected)
                checked += 1
    assert checked > 100


def test_trailing_plan_evicts_harder_than_the_intermediate_budget_at_10_percent():
    """4k prompt at 10 % (B' = 416), w = 256, floor 36: r' = 160 / 3,840; after 512 tokens a head holds
    a(512) = 64 entries (h = 36, raised to the floor), after 3,840 the window's first token arrives, and the
    peak before the last chunk stays near B' where I = 1.5 B' holds 624 entries per head."""
    base = plan_request(4096, 0.1, 32, build_policy("snapkv"), NUM_LAYERS)
    assert base.kept_bound == 416
    plan = with_chunk_budget(base, 1.5, 0, 256, 36)
    assert plan.trailing_held(512) == (36, 0) and plan.kept_length_at(512) == 64
    assert plan.trailing_held(3840) == (160, 0)
    assert plan.trailing_held(3968) == (160 + 128, 128)
    assert max(plan.kept_length_at(n) for n in range(512, 4096, 512)) < 416
    assert with_chunk_budget(base, 1.5).kept_length_at(3584) >= 624
