"""A decode-time cap with a budget pooled across layers (kvzap, ``budget_scope: "model"``, ``decode: kvzap``)
through the worker's datapath (``simulated_engine``, one storage for every layer): at each re-score the
entries every layer and head holds (this step's token included) are ranked together by the scorer's scores
of their own rows, sinks and each head's newest window first, and the best ``L · H · a(t)`` kept — the
per-layer rule's total — read back through each layer's table from sub-blocks in the blocks the scheduler
keeps (any layer's region of them); a prompt recomputed with its cap applied is ranked from the step's rows;
a failing scorer leaves every layer's newest ``a(t)`` per head."""

from __future__ import annotations

import pytest
import torch
from learned_scorers import random_scorer
from simulated_engine import DIM, HEADS, LAYERS, NUM_BLOCKS
from token_keyed_engine import MAX_POSITION, TokenKeyedEngine

from tests.unit.layout.subblock_reference import layer_table
from vllm_kvevict import metrics
from vllm_kvevict.policies.kept_masks import across_layers_mask
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.parsers import EvictionConfigError

PROMPT, BUDGET, CAP, INTERVAL, SINKS, WINDOW = 300, 64, 48, 16, 2, 8
Held = list[list[list[int]]]  # per layer, per head, positions


def engine_of(config: EvictionConfig) -> TokenKeyedEngine:
    """Scaled differently per layer, so the layers' shares of the ranking differ."""
    return TokenKeyedEngine(config, seed=11, scales=[1.0 + 2 * layer for layer in range(LAYERS)])


def config(decode: str = "kvzap", allocation: str = "uniform") -> EvictionConfig:
    params = {"window": WINDOW, "sinks": SINKS}
    cap = {"method": decode, "budget": CAP, "interval": INTERVAL, "allocation": allocation, "params": params}
    prompt = {"method": "kvzap", "budget": BUDGET, "params": {**params, "budget_scope": "model"}}
    return EvictionConfig.from_dict({**prompt, "decode": cap})


def raw_scores(engine: TokenKeyedEngine) -> torch.Tensor:
    """[L, H, MAX_POSITION] the scorer's score of each head's entry at each position."""
    scorer = random_scorer(LAYERS, HEADS, DIM)  # what the unit tests serve for layers of this shape
    keys = [engine.every_key(layer) for layer in range(LAYERS)]
    return torch.stack([scorer.layer_scores(layer, k, -k) for layer, k in enumerate(keys)])


def expected_ranking(candidates: Held, raw: torch.Tensor, keep: int) -> Held:
    """Per layer and head, the candidates the ranking across layers keeps: sinks and each head's newest
    WINDOW first, then the best ``keep`` in all by the scorer's scores."""
    scores = torch.full((LAYERS, HEADS, MAX_POSITION), float("-inf"))
    for layer, heads in enumerate(candidates):
        for head, entries in enumerate(heads):
            newest = max(entries)
            for p in entries:
                forced = p < SINKS or p > newest - WINDOW
                scores[layer, head, p] = float("inf") if forced else float(raw[layer, head, p])
    mask = across_layers_mask(scores, keep)
    return [[torch.nonzero(head).flatten().tolist() for head in layer] for layer in mask]


def decode_until(engine: TokenKeyedEngine, start: int, stop: int) -> None:
    """Decode steps t = start .. stop - 1 (the step writes position PROMPT + t - 1)."""
    for t in range(start, stop):
        engine.step([("r", PROMPT, PROMPT + t - 1, 1, None)])


def test_each_rescore_keeps_the_best_entries_of_every_layer_ranked_together() -> None:
    engine = engine_of(config())
    raw = raw_scores(engine)
    engine.step([("r", PROMPT, 0, PROMPT, None)])
    plan = engine.worker.decode.records["r"].plan
    rescores = 0
    for t in range(1, 140):
        before = engine.held_now("r")
        engine.step([("r", PROMPT, PROMPT + t - 1, 1, None)])
        if not plan.rescores_at(t):
            continue
        rescores += 1
        candidates = [[[*head, PROMPT + t - 1] for head in layer] for layer in before]
        cap = plan.kept_length(t)
        held = engine.held_now("r")  # checks every row is its own (position, head, layer)
        assert held == expected_ranking(candidates, raw, LAYERS * HEADS * cap)
        per_layer = [sum(map(len, layer)) for layer in held]
        assert sum(per_layer) == LAYERS * HEADS * cap
        assert max(per_layer) > HEADS * cap > min(per_layer)  # the layers' shares differ
        kept_blocks = set(engine.rows["r"][plan.blocks_freed(t) :])
        for layer in range(LAYERS):
            for head_subblocks in layer_table(engine.worker, "r", layer).subblocks:
                assert all(divmod(sub // HEADS, NUM_BLOCKS)[1] in kept_blocks for sub in head_subblocks)
    assert rescores >= 5
    # Between re-scores each new token lands after every head's kept entries, in every layer.
    t = next(t for t in range(140, 200) if plan.rescores_at(t))
    held = engine.held_now("r")
    decode_until(engine, 140, t)
    new = list(range(PROMPT + 139, PROMPT + t - 1))
    assert engine.held_now("r") == [[head + new for head in layer] for layer in held]


def test_two_requests_rescoring_in_one_step_each_keep_their_own_ranking() -> None:
    """Two capped requests of different prompts decode in one batch and re-score in the same steps: each
    holds its own ranking across layers, in its own kept blocks."""
    engine = engine_of(config())
    raw = raw_scores(engine)
    prompts = {"a": PROMPT, "b": PROMPT - 40}
    engine.step([(r, n, 0, n, None) for r, n in prompts.items()])
    plans = {r: engine.worker.decode.records[r].plan for r in prompts}
    both = 0
    for t in range(1, 100):
        before = {r: engine.held_now(r) for r in prompts}
        engine.step([(r, n, n + t - 1, 1, None) for r, n in prompts.items()])
        due = [r for r in prompts if plans[r].rescores_at(t)]
        both += len(due) == 2
        for r in due:
            candidates = [[[*head, prompts[r] + t - 1] for head in layer] for layer in before[r]]
            cap = plans[r].kept_length(t)
            assert engine.held_now(r) == expected_ranking(candidates, raw, LAYERS * HEADS * cap), (r, t)
            kept_blocks = set(engine.rows[r][plans[r].blocks_freed(t) :])
            for layer in range(LAYERS):
                assert {block % NUM_BLOCKS for block in engine.blocks_read(r, layer)} <= kept_blocks
    assert both >= 1  # some step re-scored both


def test_a_recomputed_request_is_ranked_across_layers_from_the_steps_rows() -> None:
    """Preempted after 100 tokens and recomputed in one step: every row it computed, in every layer, is
    ranked together down to L·H·a(100), and decoding goes on from there."""
    engine = engine_of(config())
    raw = raw_scores(engine)
    engine.step([("r", PROMPT, 0, PROMPT, None)])
    decode_until(engine, 1, 101)
    plan = engine.worker.decode.records["r"].plan
    engine.worker.drop({"r"})
    engine.step([("r", PROMPT, 0, PROMPT + 100, None)])
    every = [[list(range(PROMPT + 100))] * HEADS] * LAYERS
    cap = plan.kept_length(100)
    held = engine.held_now("r")
    assert held == expected_ranking(every, raw, LAYERS * HEADS * cap)
    assert engine.blocks_read("r", 0) <= set(engine.rows["r"][plan.blocks_freed(100) :])
    t = next(t for t in range(101, 160) if plan.rescores_at(t))
    decode_until(engine, 101, t + 1)
    held = engine.held_now("r")
    assert sum(len(head) for layer in held for head in layer) == LAYERS * HEADS * plan.kept_length(t)


def test_nan_scores_keep_every_layers_newest_entries_and_are_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_of(config())
    inner = engine.worker.decode.policy.inner
    fallbacks = metrics.process_metrics().policy_fallbacks.labels(method="kvzap", reason="nan_scores")
    engine.step([("r", PROMPT, 0, PROMPT, None)])
    plan = engine.worker.decode.records["r"].plan
    t = next(t for t in range(1, 60) if plan.rescores_at(t))
    decode_until(engine, 1, t)
    before, counted = engine.held_now("r"), fallbacks._value.get()
    monkeypatch.setattr(inner, "entry_scores", lambda layer: torch.full(layer.keys.shape[:2], float("nan")))
    decode_until(engine, t, t + 1)
    cap = plan.kept_length(t)
    newest = [[sorted([*head, PROMPT + t - 1])[-cap:] for head in layer] for layer in before]
    assert engine.held_now("r") == newest
    assert fallbacks._value.get() - counted == LAYERS
    assert "kvzap scored NaN in layer" in caplog.text


@pytest.mark.parametrize(
    ("decode", "allocation", "named"),
    [("roco", "uniform", "decode.method='roco'"), ("ada-kvzap", "uniform", "decode.method='ada-kvzap'"),
     ("kvzap", "ada", "decode.allocation='ada'")],
)  # fmt: skip
def test_a_pooled_budget_refuses_a_cap_it_cannot_rank_across_layers(
    decode: str, allocation: str, named: str
) -> None:
    with pytest.raises(EvictionConfigError, match=named) as refused:
        config(decode, allocation)
    assert "budget_scope='model'" in str(refused.value) and "valid:" in str(refused.value)
