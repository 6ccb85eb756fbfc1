"""Worker side of the decode-time cap without a server (``simulated_engine.SimulatedEngine``)."""

from __future__ import annotations

import pytest
from simulated_engine import BS, HEADS, LAYERS, SimulatedEngine

from vllm_kvevict import metrics
from vllm_kvevict.settings.config import EvictionConfig


def decode_config(prefill: str, budget: int, decode: dict) -> EvictionConfig:
    return EvictionConfig.from_dict({"method": prefill, "budget": budget, "decode": decode})


@pytest.mark.parametrize("method", ["h2o", "roco", "snapkv", "streamingllm", "kvzap", "ada-kvzap"])
@pytest.mark.parametrize("allocation", ["uniform", "ada"])
def test_a_capped_request_holds_its_cap_in_the_blocks_the_scheduler_keeps(method, allocation):
    """Prompt 300 compacted to 64 per head, cap 48 every 16 tokens, 260 decode steps next to an uncapped
    request: each head holds its own newest-first ascending entries, at most cap + k + bs - 1 of them, the
    layer at most H x a(t), all inside blocks [blocks_freed(t), ...), while the uncapped one keeps all."""
    engine = SimulatedEngine(
        decode_config(
            "snapkv", 64, {"method": method, "budget": 48, "interval": 16, "allocation": allocation}
        )
    )
    prompt, other = 300, 40
    none = {"kv_eviction": "none"}
    engine.step([("capped", prompt, 0, prompt, None), ("whole", other, 0, other, none)])
    plan = engine.worker.decode.records["capped"].plan
    assert plan.first_rescore == 1 and plan.decode_cap == 48  # 76 kept > 48 + 16: cut at once
    rescored = 0
    for t in range(1, 261):
        engine.step([("capped", prompt, prompt + t - 1, 1, None), ("whole", other, other + t - 1, 1, none)])
        rescored += plan.rescores_at(t)
        first_kept = set(engine.rows["capped"][plan.blocks_freed(t) :])
        for layer in range(LAYERS):
            held = engine.held("capped", layer)
            assert all(h == sorted(set(h)) for h in held)
            assert all(h[-1] == prompt + t - 1 for h in held)  # the newest token is always kept
            ragged = allocation == "ada" or method == "ada-kvzap"  # ada-kvzap allocates as Ada-KV
            assert max(map(len, held)) <= 48 + 16 + BS - 1 or ragged
            assert sum(map(len, held)) <= HEADS * plan.kept_length(t)
            assert engine.blocks_read("capped", layer) <= first_kept
            if method == "streamingllm" and t > 20:
                assert all(h[:4] == [0, 1, 2, 3] for h in held)  # the sinks stay
        if t % 50 == 0:
            assert engine.held("whole", 0) == [list(range(other + t))] * HEADS
    assert rescored == len([t for t in range(1, 261) if plan.rescores_at(t)]) > 10


def test_a_short_prompt_decodes_whole_until_the_rule_compacts_it():
    """``--kv-eviction roco --kv-budget 48`` with a 40-token prompt: no prefill compaction; the standard
    layout is cut at t1 = 40 (-> 48 per head), and every 16 tokens after."""
    engine = SimulatedEngine(EvictionConfig.from_dict({"method": "roco", "budget": 48}))
    recorded = metrics.process_metrics()
    counters = (recorded.decode_evictions, recorded.decode_blocks_freed, recorded.decode_tokens_evicted)
    before = [counter.labels(method="roco")._value.get() for counter in counters]
    engine.step([("r", 40, 0, 40, None)])
    plan = engine.worker.decode.records["r"].plan
    assert not plan.compacts and plan.first_rescore == 40
    for t in range(1, 120):
        engine.step([("r", 40, 40 + t - 1, 1, None)])
        if t < 40:
            assert "r" not in engine.worker.requests
            continue
        held = engine.held("r", 1)
        assert all(len(h) <= 48 + 16 - 1 + BS for h in held)
        assert engine.blocks_read("r", 1) <= set(engine.rows["r"][plan.blocks_freed(t) :])
    assert engine.worker.requests["r"] == plan
    after = [counter.labels(method="roco")._value.get() for counter in counters]
    rescores = [t for t in range(1, 120) if plan.rescores_at(t)]
    assert after[0] - before[0] == len(rescores) == 5  # t = 40, 56, 72, 88, 104
    assert after[1] - before[1] == plan.blocks_freed(119) == 5
    assert after[2] - before[2] == plan.offset(119) == 96


def test_a_recomputed_request_is_compacted_straight_to_its_cap():
    """Preempted after 200 tokens and recomputed (prompt + output in one step): the step keeps a(200) per
    head and the blocks the scheduler will keep, then decoding goes on from there."""
    engine = SimulatedEngine(decode_config("snapkv", 64, {"method": "h2o", "budget": 48, "interval": 16}))
    prompt = 300
    engine.step([("r", prompt, 0, prompt, None)])
    for t in range(1, 201):
        engine.step([("r", prompt, prompt + t - 1, 1, None)])
    plan = engine.worker.decode.records["r"].plan
    engine.worker.drop({"r"})  # preempted: the scheduler frees everything
    assert not engine.worker.decode.records
    engine.step([("r", prompt, 0, prompt + 200, None)])
    for layer in range(LAYERS):
        held = engine.held("r", layer)
        assert sum(map(len, held)) <= HEADS * plan.kept_length(200)
        assert all(h[-1] == prompt + 199 for h in held)
        assert engine.blocks_read("r", layer) <= set(engine.rows["r"][plan.blocks_freed(200) :])
    for t in range(201, 240):
        engine.step([("r", prompt, prompt + t - 1, 1, None)])
    held = engine.held("r", 0)
    assert all(len(h) <= 48 + 16 + BS - 1 for h in held) and all(h[-1] == prompt + 238 for h in held)


def test_finished_requests_leave_no_decode_state():
    engine = SimulatedEngine(decode_config("snapkv", 64, {"method": "roco", "budget": 48}))
    engine.step([("a", 100, 0, 100, None), ("b", 300, 0, 300, None)])
    for t in range(1, 40):
        engine.step([("a", 100, 99 + t, 1, None), ("b", 300, 299 + t, 1, None)])
    engine.worker.drop({"a", "b"})
    assert not engine.worker.decode.records and not engine.worker.requests


def test_a_failing_decode_policy_keeps_each_heads_newest_entries_and_is_counted(monkeypatch):
    engine = SimulatedEngine(EvictionConfig.from_dict({"method": "h2o", "budget": 48}))
    decode = engine.worker.decode

    def broken(*args, **kwargs):
        raise RuntimeError("scores went NaN")

    monkeypatch.setattr(decode.policy, "select", broken)  # the policy instance is cached per setting
    fallbacks = metrics.process_metrics().policy_fallbacks.labels(method="h2o", reason="raised")
    before = fallbacks._value.get()
    engine.step([("r", 40, 0, 40, None)])
    for t in range(1, 41):
        engine.step([("r", 40, 40 + t - 1, 1, None)])
    plan = decode.records["r"].plan
    assert plan.rescores_at(40)
    for layer in range(LAYERS):
        assert engine.held("r", layer) == [list(range(80 - 48, 80))] * HEADS
    assert fallbacks._value.get() - before == LAYERS


@pytest.mark.parametrize(("method", "needed"), [("roco", 16), ("h2o", 16), ("snapkv", 32)])
def test_a_rescore_observes_the_newest_queries_the_method_needs_prompt_ones_included(method, needed):
    """Prompt 300 kept at 76 > cap 48 + 16: the first re-score comes one token after the prompt and sees
    the prompt's last queries with that token; later ones see the newest queries_needed(k): those since the
    last re-score (H2O/RoCo) or the last window (SnapKV) — the queries the HF reference passes."""
    engine = SimulatedEngine(decode_config("snapkv", 64, {"method": method, "budget": 48, "interval": 16}))
    policy = engine.worker.decode.policy
    seen: list[list[int]] = []
    observe = policy.observe

    def spy(state, held, queries, query_positions):
        seen.append(query_positions.tolist())
        return observe(state, held, queries, query_positions)

    policy.observe = spy
    try:
        engine.step([("r", 300, 0, 300, None)])
        for t in range(1, 34):
            engine.step([("r", 300, 300 + t - 1, 1, None)])
    finally:
        del policy.observe  # the policy instance is cached per setting
    plan = engine.worker.decode.records["r"].plan
    rescored = [t for t in range(1, 34) if plan.rescores_at(t)]
    assert rescored == [1, 4, 20]  # 61 per head after t=1 (block-aligned), then every 16 tokens from 64
    assert len(seen) == len(rescored) * LAYERS
    for index, t in enumerate(rescored):
        newest = 300 + t - 1
        assert seen[index * LAYERS] == list(range(newest - needed + 1, newest + 1))
