"""Through the worker's datapath (``simulated_engine``, one storage for every layer): KVzap's threshold with a
budget pooled across layers (``budget_scope: "model"``, an adaptive plan). A request keeps every entry of
every layer and head that scores above the threshold, at most ``L·H·budget`` of them (the ceiling, ranked
across layers); its pool starts at the first block the mean layer's bound leaves; the worker reports that
bound; and once the scheduler has freed the blocks it leaves, every layer reads only its own entries while
decoding. Computed in chunks (chunked prefill, ``prefill: whole``) it keeps the same entries; evicted per
chunk (``prefill: chunked``) it holds the entries above the threshold between chunks too."""

from __future__ import annotations

import pytest
import torch
from simulated_engine import BS, HEADS, LAYERS, NUM_BLOCKS
from test_pooled_worker import PROMPT, TokenKeyedEngine, positions, prompt_scores

from vllm_kvevict.layout.accounting import cdiv, first_block_for_bound, layer_kept_bound
from vllm_kvevict.policies.kept_masks import across_layers_mask
from vllm_kvevict.settings.config import EvictionConfig

CEILING, DECODE = 160, 24


def threshold_config(tau: float, prefill: str = "whole") -> EvictionConfig:
    params = {"window": 8, "sinks": 2, "budget_scope": "model", "threshold": tau}
    raw = {"method": "kvzap", "budget": CEILING, "params": params, "prefill": prefill}
    return EvictionConfig.from_dict(raw)


def quantile_threshold(share: float) -> float:
    """The score above which about ``share`` of all the prompt's entries (every layer and head) lie."""
    scores = prompt_scores(TokenKeyedEngine(threshold_config(0.0)))
    return float(scores[scores.isfinite()].quantile(1 - share))


@pytest.mark.parametrize("chunk", [PROMPT, 96])
def test_a_request_keeps_every_entry_above_the_threshold_and_reports_its_mean_layers_bound(chunk) -> None:
    tau = quantile_threshold(0.12)
    engine = TokenKeyedEngine(threshold_config(tau))
    ceiling = engine.worker.plan_for(PROMPT)
    assert ceiling.adaptive and ceiling.pooled and ceiling.compacts
    for done in range(0, PROMPT, chunk):
        engine.step([("r", PROMPT, done, min(chunk, PROMPT - done), None)])
    keep = prompt_scores(engine) > tau
    assert int(keep.sum()) < HEADS * sum(ceiling.layer_budgets)  # the threshold, not the ceiling, decides
    assert_keeps_reports_and_decodes(engine, keep)


def assert_keeps_reports_and_decodes(engine: TokenKeyedEngine, keep: torch.Tensor) -> None:
    """After the prompt of request "r": every layer holds the entries ``keep`` [L, H, P] marks, the worker
    reported the mean layer's bound, every layer's entries lie in the blocks that bound leaves, and once the
    scheduler nulled the others the request decodes reading only its own blocks."""
    held = [engine.held("r", layer) for layer in range(LAYERS)]
    assert held == positions(keep)
    per_layer = [sum(map(len, layer)) for layer in held]
    assert len(set(per_layer)) > 1  # the layers keep different counts
    bound = layer_kept_bound(PROMPT, cdiv(sum(per_layer), LAYERS), HEADS, BS)
    assert max(layer_kept_bound(PROMPT, k, HEADS, BS) for k in per_layer) > bound  # the mean, not the largest
    assert engine.worker.records.take_kept_bounds() == {"r": bound}
    assert bound < engine.worker.plan_for(PROMPT).kept_bound
    freed = first_block_for_bound(PROMPT, bound, BS)
    assert engine.worker.records.requests["r"].blocks_to_free == freed
    row = engine.rows["r"]
    for layer in range(LAYERS):  # every layer's entries lie in the blocks the reported bound keeps
        assert {row.index(block % NUM_BLOCKS) for block in engine.blocks_read("r", layer)} <= set(
            range(freed, len(row))
        )
    row[:freed] = [0] * freed  # the scheduler's remove_skipped_blocks: null blocks
    for generated in range(DECODE):
        engine.step([("r", PROMPT, PROMPT + generated, 1, None)])
    new = list(range(PROMPT, PROMPT + DECODE))
    assert [engine.held("r", layer) for layer in range(LAYERS)] == [
        [head + new for head in layer] for layer in positions(keep)
    ]
    for layer in range(LAYERS):
        assert 0 not in {block % NUM_BLOCKS for block in engine.blocks_read("r", layer)}


def test_with_more_entries_above_the_threshold_the_request_keeps_the_ceilings_ranking() -> None:
    engine = TokenKeyedEngine(threshold_config(quantile_threshold(0.9)))
    ceiling = engine.worker.plan_for(PROMPT)
    engine.step([("r", PROMPT, 0, PROMPT, None)])
    expected = across_layers_mask(prompt_scores(engine), HEADS * sum(ceiling.layer_budgets))
    assert [engine.held("r", layer) for layer in range(LAYERS)] == positions(expected)
    assert engine.worker.records.take_kept_bounds() == {"r": ceiling.kept_bound}


def test_a_threshold_with_a_pooled_budget_keeps_no_context_and_is_evicted_between_chunks() -> None:
    from vllm_kvevict.settings.learned_methods import chunked_problem

    policy = threshold_config(1.0).build_policy()
    assert policy.kept_context_form(BS) is None
    assert chunked_problem("kvzap", policy) is None
    per_layer = EvictionConfig.from_dict({"method": "kvzap", "budget": CEILING, "params": {"threshold": 1.0}})
    assert "threshold" in str(chunked_problem("kvzap", per_layer.build_policy()))


def test_per_chunk_a_request_holds_the_entries_above_the_threshold_between_chunks_and_after() -> None:
    """``prefill: chunked``: between chunks each layer holds its arrived entries above the threshold, the
    sinks and the newest window (the rule's ``L·H·a(n)`` at most, fewer here), and after the last chunk what
    the whole prompt keeps; the bound reported and the decode that follows are the whole prompt's."""
    tau = quantile_threshold(0.12)
    raw = {**threshold_config(tau, "chunked").to_dict(), "chunk_budget": CEILING}
    engine = TokenKeyedEngine(EvictionConfig.from_dict(raw))
    plan = engine.worker.plan_for(PROMPT)
    keep = prompt_scores(engine) > tau  # token-keyed rows: a chunk's scores are the whole prompt's
    chunk, window, evicted = 96, engine.worker.policy.window, 0
    for done in range(0, PROMPT, chunk):
        end = min(done + chunk, PROMPT)
        engine.step([("r", PROMPT, done, end - done, None)])
        if end == PROMPT or not plan.prefill_offset(end):
            continue
        evicted += 1
        arrived = keep[:, :, :end].clone()
        arrived[:, :, end - window :] = True  # the newest window of the arrived tokens, forced
        held = [engine.held("r", layer) for layer in range(LAYERS)]
        assert held == positions(arrived)
        assert int(arrived.sum()) < LAYERS * HEADS * plan.kept_length_at(end)  # the threshold decides
    assert evicted == 3
    assert_keeps_reports_and_decodes(engine, keep)


def test_a_recomputed_request_keeps_the_same_entries_and_its_generated_tokens_after_them() -> None:
    """Preempted and recomputed (its prompt and 8 generated tokens in one step), a request keeps what the
    threshold keeps of its prompt, every generated token in every head after it, in the blocks its reported
    bound leaves (the tokens after the prompt take pool entries after every layer's kept ones)."""
    tau, generated = quantile_threshold(0.12), 8
    engine = TokenKeyedEngine(threshold_config(tau))
    engine.step([("r", PROMPT, 0, PROMPT + generated, None)])
    keep = prompt_scores(engine) > tau
    after = list(range(PROMPT, PROMPT + generated))
    held = [engine.held("r", layer) for layer in range(LAYERS)]
    assert held == [[head + after for head in layer] for layer in positions(keep)]
    per_layer = [int(keep[layer].sum()) for layer in range(LAYERS)]
    bound = layer_kept_bound(PROMPT, cdiv(sum(per_layer), LAYERS), HEADS, BS)
    assert engine.worker.records.take_kept_bounds() == {"r": bound}
    freed, row = first_block_for_bound(PROMPT, bound, BS), engine.rows["r"]
    for layer in range(LAYERS):
        assert min(row.index(block % NUM_BLOCKS) for block in engine.blocks_read("r", layer)) >= freed
