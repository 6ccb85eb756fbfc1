"""Decode-time caps with the learned scorer through the worker's datapath (``simulated_engine``): every
re-score hands the method what the layer holds as one ``HeldLayer`` (keys and values read from the cache,
positions, the layer index), and each head then holds its top-``a(t)`` of the scorer's scores over those
entries (sinks and newest kept), in the blocks the scheduler keeps; a prompt recomputed with its cap applied
is judged from the step's keys and values; NaN scores fall back to the newest entries through the guard."""

from __future__ import annotations

import pytest
import torch
from learned_scorers import random_scorer
from simulated_engine import DIM, HEADS, LAYERS, SimulatedEngine
from token_keyed_engine import TokenKeyedEngine

from vllm_kvevict import metrics
from vllm_kvevict.policies.decode import HeldLayer
from vllm_kvevict.policies.decode.decode_policy import ada_caps_from_scores
from vllm_kvevict.settings.config import EvictionConfig

PROMPT, CAP, INTERVAL, SINKS, WINDOW = 300, 48, 16, 2, 8


def engine_of(config: EvictionConfig) -> TokenKeyedEngine:
    return TokenKeyedEngine(config, seed=7, scales=[3.0] * LAYERS)


def decode_config(method: str, allocation: str = "uniform") -> EvictionConfig:
    decode = {"method": method, "budget": CAP, "interval": INTERVAL, "allocation": allocation}
    return EvictionConfig.from_dict(
        {"method": "snapkv", "budget": 64, "decode": {**decode, "params": {"window": WINDOW, "sinks": SINKS}}}
    )


def scorer_scores(engine: TokenKeyedEngine) -> list[torch.Tensor]:
    """Per layer, [H, MAX_POSITION] the scorer's score of each head's entry at each position, plus inf for
    the sinks (the window depends on what is newest: ``expected``)."""
    scorer = random_scorer(LAYERS, HEADS, DIM)  # what the unit tests serve for layers of this shape
    return [
        scorer.layer_scores(layer, keys, -keys)
        for layer, keys in enumerate(map(engine.every_key, range(LAYERS)))
    ]


def expected(held: HeldLayer, raw: torch.Tensor, caps: list[int]) -> list[list[int]]:
    """Per head, the positions its top caps[h] keep: sinks, the newest WINDOW, then the best scores."""
    kept = []
    for h, cap in enumerate(caps):
        entries = [int(p) for p in held.positions[h] if p >= 0]
        newest = max(entries)
        forced = [p for p in entries if p < SINKS or p > newest - WINDOW]
        rest = sorted((p for p in entries if p not in forced), key=lambda p: -float(raw[h, p]))
        kept.append(sorted(forced[:cap] + rest[: max(0, cap - len(forced))]))
    return kept


def spy_on_select(monkeypatch: pytest.MonkeyPatch, engine: SimulatedEngine) -> list[tuple[HeldLayer, object]]:
    """Every (held, caps) the decode method's ``select`` is given."""
    policy = engine.worker.decode.policy
    calls: list[tuple[HeldLayer, object]] = []
    select = policy.select

    def spy(state, held, cap):
        calls.append((held, cap))
        return select(state, held, cap)

    monkeypatch.setattr(policy, "select", spy)  # the policy instance is cached per setting: undone after
    return calls


def check_rows(held: HeldLayer, layer: int) -> None:
    """The keys and values read are each held entry's own rows (marks), values minus keys."""
    valid = held.valid
    assert held.layer_idx == layer and held.num_layers == LAYERS
    assert held.keys is not None and held.values is not None
    assert torch.equal(held.keys[..., 0][valid], held.positions[valid].float())
    assert (held.keys[..., 1][valid] == torch.arange(HEADS)[:, None].expand_as(valid)[valid]).all()
    assert (held.keys[..., 2][valid] == layer).all()
    assert torch.equal(held.values[valid], -held.keys[valid])


@pytest.mark.parametrize(
    ("method", "allocation"), [("kvzap", "uniform"), ("kvzap", "ada"), ("ada-kvzap", "uniform")]
)
def test_each_rescore_keeps_the_top_of_the_scorers_scores_over_what_each_head_holds(
    monkeypatch: pytest.MonkeyPatch, method: str, allocation: str
) -> None:
    engine = engine_of(decode_config(method, allocation))
    raw = scorer_scores(engine)
    calls = spy_on_select(monkeypatch, engine)
    engine.step([("r", PROMPT, 0, PROMPT, None)])
    plan = engine.worker.decode.records["r"].plan
    rescores = 0
    for t in range(1, 120):
        engine.step([("r", PROMPT, PROMPT + t - 1, 1, None)])
        if not plan.rescores_at(t):
            assert not calls
            continue
        rescores += 1
        assert len(calls) == LAYERS
        cap = plan.kept_length(t)
        for layer, (held, caps) in enumerate(calls):
            check_rows(held, layer)
            if method == "kvzap" and allocation == "uniform":
                assert caps == cap
                caps = [cap] * HEADS
            else:  # Ada-KV caps from the same scores: the layer keeps H x a(t), heads ragged
                newest = held.positions.amax(dim=1, keepdim=True)
                always = held.valid & ((held.positions < SINKS) | (held.positions > newest - WINDOW))
                scores = raw[layer].gather(1, held.positions.clamp(min=0)).masked_fill(always, float("inf"))
                assert torch.equal(caps, ada_caps_from_scores(scores, held.positions, cap, 0.2))
                assert int(caps.sum()) == HEADS * cap
                caps = caps.tolist()
            now = engine.held("r", layer)
            assert now == expected(held, raw[layer], caps)
            assert engine.blocks_read("r", layer) <= set(engine.rows["r"][plan.blocks_freed(t) :])
        calls.clear()
    assert rescores >= 5


def test_a_recomputed_request_is_judged_from_the_steps_keys_and_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Preempted after 100 tokens and recomputed in one step: the cap's choice sees the prompt's kept
    entries and the recomputed output with their own keys and values, and keeps the scorer's top a(100)."""
    engine = engine_of(decode_config("kvzap"))
    raw = scorer_scores(engine)
    engine.step([("r", PROMPT, 0, PROMPT, None)])
    for t in range(1, 101):
        engine.step([("r", PROMPT, PROMPT + t - 1, 1, None)])
    plan = engine.worker.decode.records["r"].plan
    engine.worker.drop({"r"})
    calls = spy_on_select(monkeypatch, engine)
    engine.step([("r", PROMPT, 0, PROMPT + 100, None)])
    assert len(calls) == LAYERS
    for layer, (held, caps) in enumerate(calls):
        check_rows(held, layer)
        assert int(held.positions.max()) == PROMPT + 99 and caps == plan.kept_length(100)
        assert engine.held("r", layer) == expected(held, raw[layer], [caps] * HEADS)


def test_nan_scores_fall_back_to_each_heads_newest_entries_and_are_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_of(decode_config("kvzap"))
    inner = engine.worker.decode.policy.inner
    monkeypatch.setattr(inner, "entry_scores", lambda layer: torch.full(layer.keys.shape[:2], float("nan")))
    fallbacks = metrics.process_metrics().policy_fallbacks.labels(method="kvzap", reason="nan_scores")
    before = fallbacks._value.get()
    engine.step([("r", PROMPT, 0, PROMPT, None)])
    plan = engine.worker.decode.records["r"].plan
    t = next(t for t in range(1, 60) if plan.rescores_at(t))
    for step in range(1, t):
        engine.step([("r", PROMPT, PROMPT + step - 1, 1, None)])
    held_before = [engine.held("r", layer) for layer in range(LAYERS)]
    engine.step([("r", PROMPT, PROMPT + t - 1, 1, None)])
    cap = plan.kept_length(t)
    for layer in range(LAYERS):
        newest = [sorted([*head, PROMPT + t - 1])[-cap:] for head in held_before[layer]]
        assert engine.held("r", layer) == newest
    assert fallbacks._value.get() - before == LAYERS
    assert "kvzap scored NaN in layer 2" in caplog.text
