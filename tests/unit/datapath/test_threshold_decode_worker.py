"""KVzap's threshold (an adaptive plan) with a decode-time cap, through the worker's datapath
(``simulated_engine``, the scheduler's frees applied by nulling the blocks it frees): the prompt keeps what
scores above the threshold and reports its bound; from then on the cap re-scores on the rule of that bound
(``with_kept_bound``: its own O0 and first re-score, the plan the scheduler frees blocks by), keeping each
head's or every layer's best ``a(t)`` in the blocks that plan leaves. A prompt recomputed with its cap
applied keeps the a(t) of the plan it was admitted with and reports no bound, so both sides go on by it."""

from __future__ import annotations

import pytest
import torch
from simulated_engine import HEADS, LAYERS, NUM_BLOCKS
from test_pooled_decode_worker import SINKS, WINDOW, expected_ranking, raw_scores
from token_keyed_engine import TokenKeyedEngine

from vllm_kvevict.layout.accounting import RequestPlan, with_kept_bound
from vllm_kvevict.settings.config import EvictionConfig

PROMPT, CEILING, CAP, INTERVAL = 300, 160, 96, 16
Held = list[list[list[int]]]


def config(tau: float, pooled: bool) -> EvictionConfig:
    params = {"window": WINDOW, "sinks": SINKS}
    prompt = {**params, "threshold": tau, **({"budget_scope": "model"} if pooled else {})}
    cap = {"method": "kvzap", "budget": CAP, "interval": INTERVAL, "params": params}
    return EvictionConfig.from_dict({"method": "kvzap", "budget": CEILING, "params": prompt, "decode": cap})


def engine_of(pooled: bool, share: float = 0.1) -> tuple[TokenKeyedEngine, torch.Tensor]:
    """An engine whose threshold keeps about ``share`` of the prompt's entries, and the scorer's scores
    [L, H, MAX_POSITION] of every entry."""
    scales = [1.0 + 2 * layer for layer in range(LAYERS)]
    raw = raw_scores(TokenKeyedEngine(config(0.0, pooled), seed=11, scales=scales))
    tau = float(raw[:, :, :PROMPT].quantile(1 - share))
    return TokenKeyedEngine(config(tau, pooled), seed=11, scales=scales), raw


def best_per_head(candidates: Held, raw: torch.Tensor, keep: int) -> Held:
    """Per layer and head, the candidates a per-layer cap keeps: sinks and the newest WINDOW, then the best
    by the scorer's scores, ``keep`` per head at most."""
    kept: Held = []
    for layer, heads in enumerate(candidates):
        kept.append([])
        for head, entries in enumerate(heads):
            newest = max(entries)
            forced = [p for p in entries if p < SINKS or p > newest - WINDOW]
            rest = sorted((p for p in entries if p not in forced), key=lambda p: -float(raw[layer, head, p]))
            kept[-1].append(sorted(forced + rest[: max(0, keep - len(forced))]))
    return kept


def decode_as_scheduled(
    engine: TokenKeyedEngine, scheduler: RequestPlan, start: int, stop: int, raw: torch.Tensor, pooled: bool
) -> int:
    """Decode steps t = start .. stop - 1, the scheduler freeing ``scheduler.blocks_freed`` before each;
    every step reads no freed block, and every re-score of ``scheduler``'s rule keeps the cap's best
    entries (and only then does anything but append). Returns the re-scores seen."""
    row, rescores = engine.rows["r"], 0
    for t in range(start, stop):
        freed = scheduler.blocks_freed(t - 1)
        row[:freed] = [0] * freed  # the scheduler's remove_skipped_blocks: null blocks
        before = engine.held_now("r")
        engine.step([("r", PROMPT, PROMPT + t - 1, 1, None)])
        for layer in range(LAYERS):
            assert 0 not in {block % NUM_BLOCKS for block in engine.blocks_read("r", layer)}, (t, layer)
        candidates = [[[*head, PROMPT + t - 1] for head in layer] for layer in before]
        held = engine.held_now("r")
        if not scheduler.rescores_at(t):
            assert held == candidates, t
            continue
        rescores += 1
        cap = scheduler.kept_length(t)
        if pooled:
            assert held == expected_ranking(candidates, raw, LAYERS * HEADS * cap), t
        else:
            assert held == best_per_head(candidates, raw, cap), t
    return rescores


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "per-layer"])
def test_the_cap_rescores_on_the_rule_of_the_bound_the_prompt_reported(pooled: bool) -> None:
    engine, raw = engine_of(pooled)
    ceiling = engine.worker.plan_for(PROMPT)
    assert ceiling.adaptive and ceiling.decode_cap == CAP
    engine.step([("r", PROMPT, 0, PROMPT, None)])
    bound = engine.worker.records.take_kept_bounds()["r"]
    scheduler = with_kept_bound(ceiling, bound)
    # The ceiling would cut the prompt at the first token; the bound's rule lets it grow first.
    assert ceiling.first_rescore == 1 < scheduler.first_rescore
    assert engine.worker.decode.records["r"].plan == scheduler
    assert decode_as_scheduled(engine, scheduler, 1, 200, raw, pooled) >= 5


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "per-layer"])
def test_a_prompt_recomputed_with_its_cap_applied_reports_no_bound(pooled: bool) -> None:
    """Preempted after 60 tokens (past the bound's first re-score) and recomputed in one step: the request
    keeps the a(60) of its admitted plan, reports no bound, and decodes on that plan's rule."""
    engine, raw = engine_of(pooled)
    ceiling = engine.worker.plan_for(PROMPT)
    engine.step([("r", PROMPT, 0, PROMPT, None)])
    engine.worker.records.take_kept_bounds()
    decode_as_scheduled(engine, engine.worker.decode.records["r"].plan, 1, 61, raw, pooled)
    engine.worker.drop({"r"})
    engine.rows["r"] = list(range(1, len(engine.rows["r"]) + 1))  # fresh blocks, as after a preemption
    engine.step([("r", PROMPT, 0, PROMPT + 60, None)])
    assert engine.worker.records.take_kept_bounds() == {}
    assert engine.worker.records.requests["r"] == ceiling
    assert engine.worker.decode.records["r"].plan == ceiling
    held, cap = engine.held_now("r"), ceiling.kept_length(60)
    if pooled:
        assert sum(len(head) for layer in held for head in layer) == LAYERS * HEADS * cap
    else:  # a head keeps the cap's count, or all it had where the threshold kept fewer
        assert max(len(head) for layer in held for head in layer) == cap
    assert decode_as_scheduled(engine, ceiling, 61, 200, raw, pooled) >= 5
