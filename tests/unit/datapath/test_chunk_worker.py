"""Worker side of per-chunk eviction (chunked prefill) without a server: ``simulated_engine.SimulatedEngine``
drives the worker as the CPU backend does, and every cached row says which (position, head, layer) it is."""

from __future__ import annotations

import pytest
from simulated_engine import HEADS, LAYERS, SimulatedEngine

from vllm_kvevict.settings.config import EvictionConfig

PROMPT = 400
CHUNK = 96  # chunks end at 96, 192, 288, 384, then 400


def chunk_config(
    method: str,
    budget: int = 64,
    chunk_budget: int | float = 96,
    between: str = "window",
    trailing_window: int = 0,
) -> EvictionConfig:
    """Prefill eviction only (StreamingLLM and H2O imply a decode-time cap, which keeps prompts whole)."""
    return EvictionConfig.from_dict(
        {
            "method": method,
            "budget": budget,
            "prefill": "chunked",
            "chunk_budget": chunk_budget,
            "between": between,
            "trailing_window": trailing_window,
            "decode": {"method": "none"},
        }
    )


def prefill_in_chunks(engine: SimulatedEngine, req_id: str) -> None:
    """Runs the prompt chunk by chunk."""
    done = 0
    while done < PROMPT:
        step = min(CHUNK, PROMPT - done)
        engine.step([(req_id, PROMPT, done, step, None)])
        done += step


@pytest.mark.parametrize(
    ("method", "between"),
    [
        *[(m, "window") for m in ("snapkv", "ada-snapkv", "pyramidkv", "critical-ada-snapkv")],
        *[(m, "window") for m in ("streamingllm", "nacl", "h2o", "keydiff")],
        ("ada-snapkv", "keydiff"),
        ("ada-snapkv", "blend"),
        ("critical-ada-snapkv", "blend"),
    ],
)
def test_each_chunk_leaves_every_head_its_intermediate_budget_in_the_blocks_the_scheduler_keeps(
    method, between, caplog
):
    """Between chunks each head holds exactly a(n) = n - O(n) of its own entries (the newest window
    included, ascending), only in blocks [blocks_freed_at(n), ...); once the prompt is complete each layer
    holds H x its layer budget, and decoding then appends to every head."""
    engine = SimulatedEngine(chunk_config(method, between=between))
    assert engine.worker.chunks.between.kind == between
    plan = engine.worker.plan_for(PROMPT)
    assert plan.compacts and plan.chunk_budget == 96
    done = 0
    evicted_between = 0
    while done < PROMPT:
        step = min(CHUNK, PROMPT - done)
        engine.step([("r", PROMPT, done, step, None)])
        done += step
        if done == PROMPT:
            break
        if plan.prefill_offset(done) == 0:
            assert "r" not in engine.worker.chunks.positions  # nothing evicted yet: standard layout
            continue
        evicted_between += 1
        kept_blocks = set(engine.rows["r"][plan.blocks_freed_at(done) :])
        for layer in range(LAYERS):
            held = engine.held("r", layer)
            assert [len(h) for h in held] == [plan.kept_length_at(done)] * HEADS
            assert all(h == sorted(set(h)) and h[-1] == done - 1 for h in held)
            assert engine.blocks_read("r", layer) <= kept_blocks
    assert evicted_between == 3  # after 192, 288 and 384 tokens
    kept_blocks = set(engine.rows["r"][plan.blocks_freed_at(PROMPT) :])
    for layer in range(LAYERS):
        held = engine.held("r", layer)
        assert sum(map(len, held)) == HEADS * plan.layer_budgets[layer]
        assert all(h == sorted(set(h)) and h[-1] == PROMPT - 1 for h in held)
        assert engine.blocks_read("r", layer) <= kept_blocks
    before = [len(h) for h in engine.held("r", LAYERS - 1)]
    for t in range(40):
        engine.step([("r", PROMPT, PROMPT + t, 1, None)])
    after = engine.held("r", LAYERS - 1)
    assert [len(h) for h in after] == [n + 40 for n in before]
    assert all(h[-40:] == list(range(PROMPT, PROMPT + 40)) for h in after)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], (
        "a policy fell back to its newest entries"
    )


@pytest.mark.parametrize(("method", "between"), [("ada-snapkv", "blend"), ("snapkv", "expected-attention")])
def test_a_trailing_window_is_held_whole_and_the_rest_follows_the_prompt_length(method, between, caplog):
    """FastKVzip's rule (``trailing_window`` = 64 of a 400-token prompt, more than the method's window of 32):
    after each evicting chunk every head holds the plan's a(n) (the rule's count, block-aligned) with every
    arrived token of the prompt's last 64 among them; the prompt then ends at its layer budgets with its
    last 32 (SnapKV's window) kept."""
    engine = SimulatedEngine(chunk_config(method, between=between, trailing_window=64))
    plan = engine.worker.plan_for(PROMPT)
    assert plan.trailing_window == 64 and plan.trailing_held(384) == (plan.trailing_held(336)[0] + 48, 48)
    done, protected_seen = 0, 0
    while done < PROMPT:
        step = min(CHUNK, PROMPT - done)
        engine.step([("r", PROMPT, done, step, None)])
        done += step
        if done == PROMPT or plan.prefill_offset(done) == 0:
            continue
        window = set(range(PROMPT - 64, done))
        protected_seen += len(window)
        for layer in range(LAYERS):
            held = engine.held("r", layer)
            assert [len(h) for h in held] == [plan.kept_length_at(done)] * HEADS
            assert all(window <= set(h) for h in held)
    assert protected_seen == 48  # after 384 tokens: 336..383
    for layer in range(LAYERS):
        held = engine.held("r", layer)
        assert sum(map(len, held)) == HEADS * plan.layer_budgets[layer]
        assert all(h[-32:] == list(range(PROMPT - 32, PROMPT)) for h in held)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], (
        "a policy fell back to its newest entries"
    )


def test_chunked_requests_share_steps_with_whole_and_decoding_requests():
    """A chunked request beside a decoding compacted one and a whole short prompt: each keeps its own."""
    engine = SimulatedEngine(chunk_config("ada-snapkv"))
    engine.step([("early", PROMPT, 0, PROMPT, None)])  # whole prompt in one step: today's path
    early = sum(len(h) for h in engine.held("early", 0))
    done = 0
    while done < PROMPT:
        step = min(CHUNK, PROMPT - done)
        engine.step(
            [("early", PROMPT, PROMPT + done // CHUNK, 1, None), ("chunked", PROMPT, done, step, None)]
        )
        done += step
    decoded = -(-PROMPT // CHUNK)
    engine.step(
        [
            ("early", PROMPT, PROMPT + decoded, 1, None),
            ("chunked", PROMPT, PROMPT, 1, None),
            ("short", 40, 0, 40, {"kv_eviction": "none"}),
        ]
    )
    assert sum(len(h) for h in engine.held("early", 0)) == early + HEADS * (decoded + 1)
    held = engine.held("chunked", 1)
    assert sum(map(len, held)) == HEADS * (engine.worker.plan_for(PROMPT).layer_budgets[1] + 1)
    assert all(h[-1] == PROMPT for h in held)
    assert engine.held("short", 0) == [list(range(40))] * HEADS


def test_a_prompt_whose_first_step_is_not_at_token_zero_is_compacted_from_the_cache():
    """chunk_budget as large as the prompt: nothing is evicted between chunks, and the final chunk compacts
    the whole prompt read back from the standard layout."""
    engine = SimulatedEngine(chunk_config("snapkv", chunk_budget=PROMPT))
    prefill_in_chunks(engine, "r")
    plan = engine.worker.plan_for(PROMPT)
    for layer in range(LAYERS):
        held = engine.held("r", layer)
        assert [len(h) for h in held] == [plan.layer_budgets[layer]] * HEADS
        assert all(h[-32:] == list(range(PROMPT - 32, PROMPT)) for h in held)  # SnapKV keeps its window


def test_finished_and_restarted_requests_leave_no_chunk_state():
    engine = SimulatedEngine(chunk_config("snapkv"))
    engine.step([("r", PROMPT, 0, CHUNK, None)])
    engine.step([("r", PROMPT, CHUNK, CHUNK, None)])
    assert "r" in engine.worker.chunks.positions
    engine.step([("r", PROMPT, 0, CHUNK, None)])  # recomputed after preemption: from scratch
    assert "r" not in engine.worker.chunks.positions
    engine.worker.drop(["r"])
    assert not engine.worker.chunks.positions


def test_a_chunk_that_evicts_nothing_is_held_whole_until_the_next_eviction():
    """192 tokens (evicts to a(192)), then 8 (the offset stays), then 88 (evicts again): the second eviction
    scores the entries kept at 192 plus all 96 tokens since, and keeps a(288) of them per head."""
    engine = SimulatedEngine(chunk_config("snapkv"))
    plan = engine.worker.plan_for(PROMPT)
    engine.step([("r", PROMPT, 0, 192, None)])
    assert plan.chunk_rescores(0, 192) and not plan.chunk_rescores(192, 200) and plan.chunk_rescores(200, 288)
    engine.step([("r", PROMPT, 192, 8, None)])
    kept_at_192 = engine.held("r", 1)
    assert all(h[-8:] == list(range(192, 200)) for h in kept_at_192)
    engine.step([("r", PROMPT, 200, 88, None)])
    for layer in range(LAYERS):
        held = engine.held("r", layer)
        assert [len(h) for h in held] == [plan.kept_length_at(288)] * HEADS
        assert all(h == sorted(set(h)) and h[-1] == 287 for h in held)
    later = set(range(200, 288))
    assert all(set(h) <= set(old) | later for h, old in zip(engine.held("r", 1), kept_at_192, strict=True))


def test_a_recomputed_request_whose_last_chunk_runs_past_the_prompt_keeps_its_output_tokens():
    """After preemption vLLM recomputes prompt + output as one prefill; its chunk that crosses the prompt's
    end compacts the prompt to the layer budgets and keeps the 20 recomputed output tokens after them."""
    engine = SimulatedEngine(chunk_config("ada-snapkv"))
    plan = engine.worker.plan_for(PROMPT)
    for done in range(0, 384, CHUNK):
        engine.step([("r", PROMPT, done, CHUNK, None)])
    engine.step([("r", PROMPT, 384, 36, None)])
    for layer in range(LAYERS):
        held = engine.held("r", layer)
        assert sum(map(len, held)) == HEADS * (plan.layer_budgets[layer] + 20)
        assert all(h[-20:] == list(range(PROMPT, PROMPT + 20)) for h in held)
    engine.step([("r", PROMPT, 420, 1, None)])
    assert all(h[-1] == 420 for h in engine.held("r", 0))
