"""Prefix caching with a budget pooled across layers (kvzap, ``budget_scope: "model"``) through the worker's
datapath (``simulated_engine``, one storage for every layer): a request that starts from blocks another
request published keeps them whole and unwritten, every layer reading them in its own region, and ranks
only its own part across layers (``H · Σ_l B_l`` of the private plan), placed in the blocks after its freed
range; its new tokens follow in every layer."""

from __future__ import annotations

import torch
from simulated_engine import BS, HEADS, LAYERS, NUM_BLOCKS
from test_pooled_decode_worker import SINKS, WINDOW, expected_ranking, raw_scores
from token_keyed_engine import TokenKeyedEngine

from vllm_kvevict.layout.shared_prefix import first_kept_block, publishable_tokens, reads_prefix_cache
from vllm_kvevict.settings.config import EvictionConfig

PROMPT, DECODE = 400, BS + 2


def pooled_config() -> EvictionConfig:
    params = {"window": WINDOW, "sinks": SINKS, "budget_scope": "model"}
    raw = {"method": "kvzap", "budget": 0.25, "params": params, "prefill": "whole", "min_freed_share": 0.0}
    return EvictionConfig.from_dict({**raw, "decode": {"method": "none"}})


def test_a_pooled_request_on_a_shared_prefix_keeps_it_whole_and_ranks_only_its_own_part() -> None:
    engine = TokenKeyedEngine(pooled_config(), seed=3, scales=[1.0 + 2 * layer for layer in range(LAYERS)])
    worker, raw = engine.worker, raw_scores(engine)
    engine.step([("owner", PROMPT, 0, PROMPT, None)])
    owner_plan = worker.plan_for(PROMPT)
    assert owner_plan.pooled and reads_prefix_cache(owner_plan)
    published = publishable_tokens(owner_plan, 0)
    assert owner_plan.compacts and published == owner_plan.blocks_to_free * BS
    shared_blocks = published // BS
    shared = shared_blocks * BS
    owner_held = engine.held_now("owner")

    engine.share_prefix("sharer", "owner", shared_blocks)
    prefix_rows = engine.rows["sharer"][:shared_blocks]
    before = [cache[prefix_rows].clone() for cache in engine.caches]
    # The owner decodes in the same batch while the sharer computes the rest of its prompt.
    engine.step([("owner", PROMPT, PROMPT, 1, None), ("sharer", PROMPT, shared, PROMPT - shared, None)])

    assert worker.shared_tokens["sharer"] == shared
    private = worker.plan_for(PROMPT - shared)
    assert private.compacts and private.pooled
    own_part = [[list(range(shared, PROMPT))] * HEADS] * LAYERS
    expected = expected_ranking(own_part, raw, HEADS * sum(private.layer_budgets))
    row = engine.rows["sharer"]
    first = first_kept_block(private, shared, PROMPT)
    assert first == shared_blocks + private.blocks_to_free
    held = engine.held_now("sharer")  # checks every row is its own (position, head, layer)
    regions = []  # other layers' regions each layer reads
    for layer in range(LAYERS):
        assert torch.equal(engine.caches[layer][prefix_rows], before[layer]), "a shared block was written"
        assert [head[:shared] for head in held[layer]] == [list(range(shared))] * HEADS
        assert [head[shared:] for head in held[layer]] == expected[layer]
        blocks = {block % NUM_BLOCKS for block in engine.blocks_read("sharer", layer)}
        assert blocks <= set(row[:shared_blocks]) | set(row[first:])  # the freed range is never read
        regions.append({block // NUM_BLOCKS for block in engine.blocks_read("sharer", layer)} - {layer})
        assert engine.held("owner", layer) == [head + [PROMPT] for head in owner_held[layer]]
    assert any(regions)  # its own part lies in other layers' regions too: one pool
    own = [sum(len(head) - shared for head in layer) for layer in held]
    assert sum(own) == HEADS * sum(private.layer_budgets) and len(set(own)) > 1  # the layers' shares differ

    for t in range(DECODE):  # decoding crosses into a new block of the sharer's pool
        engine.step([("sharer", PROMPT, PROMPT + t, 1, None)])
    new = list(range(PROMPT, PROMPT + DECODE))
    assert engine.held_now("sharer") == [[head + new for head in layer] for layer in held]
    for layer in range(LAYERS):
        blocks = {block % NUM_BLOCKS for block in engine.blocks_read("sharer", layer)}
        assert blocks <= set(row[:shared_blocks]) | set(row[first:])
