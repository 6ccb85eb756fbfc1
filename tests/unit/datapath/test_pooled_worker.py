"""Through the worker's datapath (``simulated_engine``, one storage for every layer): a budget pooled across
layers (kvzap, ``budget_scope: "model"``). The prompt's entries of every layer and head are ranked together;
each layer holds exactly its share of the ranking, read back through its table from sub-blocks that may lie
in any layer's region of the request's kept blocks; the entries written while decoding follow each head's
kept ones; and a failing scorer leaves each layer's newest entries."""

from __future__ import annotations

import pytest
import torch
from simulated_engine import BS, DIM, HEADS, LAYERS, NUM_BLOCKS, SimulatedEngine

from tests.unit.layout.subblock_reference import layer_table
from vllm_kvevict.datapath.pooled_eviction import kept_across_layers
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.policies.base import LayerKV
from vllm_kvevict.policies.kept_masks import across_layers_mask
from vllm_kvevict.settings.config import EvictionConfig

PROMPT, BUDGET, DECODE = 400, 64, 40


class TokenKeyedEngine(SimulatedEngine):
    """Keys and values of a token depend on (position, layer) alone, scaled differently per layer, so the
    ranking gives the layers different shares."""

    def __init__(self, config: EvictionConfig) -> None:
        super().__init__(config)
        g = torch.Generator().manual_seed(5)
        scale = [30 + 200 * layer for layer in range(LAYERS)]
        self.token_keys = [torch.randn(PROMPT + DECODE, HEADS, DIM, generator=g) * s for s in scale]

    def tokens(self, positions: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, _ = super().tokens(positions, layer)  # the (position, head, layer) marks
        key[:, :, 3:] = self.token_keys[layer][positions][:, :, 3:]
        return query, key, -key


def pooled_config() -> EvictionConfig:
    return EvictionConfig.from_dict(
        {"method": "kvzap", "budget": BUDGET, "params": {"window": 8, "sinks": 2, "budget_scope": "model"}}
    )


def prompt_scores(engine: TokenKeyedEngine) -> torch.Tensor:
    """[L, H, P] the policy's scores of the prompt's entries as the engine writes them (``+inf``: sinks and
    window)."""
    policy, plan = engine.worker.policy, engine.worker.plan_for(PROMPT)
    scores = []
    for layer in range(LAYERS):
        _, key, value = engine.tokens(torch.arange(PROMPT), layer)
        rows = LayerKV(
            keys=key.transpose(0, 1), values=value.transpose(0, 1), queries=torch.zeros(HEADS, 0, DIM),
            layer_idx=layer, num_layers=LAYERS,
        )  # fmt: skip
        scores.append(policy.score(rows, plan.layer_budgets[layer]))
    return torch.stack(scores)


def positions(keep: torch.Tensor) -> list[list[list[int]]]:
    """Per layer and head, the positions ``keep`` [L, H, P] marks."""
    return [[torch.nonzero(head).flatten().tolist() for head in layer] for layer in keep]


def expected_kept(engine: TokenKeyedEngine) -> list[list[list[int]]]:
    """Per layer and head, the positions the pooled ranking keeps of the prompt (the policy's own scores)."""
    plan = engine.worker.plan_for(PROMPT)
    return positions(across_layers_mask(prompt_scores(engine), HEADS * sum(plan.layer_budgets)))


def test_every_layer_holds_its_share_of_the_ranking_across_layers_while_decoding() -> None:
    engine = TokenKeyedEngine(pooled_config())
    plan = engine.worker.plan_for(PROMPT)
    engine.step([("r", PROMPT, 0, PROMPT, None)])
    expected = expected_kept(engine)
    held = [engine.held("r", layer) for layer in range(LAYERS)]  # checks each row's own (head, layer) marks
    assert held == expected
    counts = [[len(head) for head in layer] for layer in held]
    assert sum(map(sum, counts)) == HEADS * sum(plan.layer_budgets)
    assert max(map(sum, counts)) > HEADS * BUDGET > min(map(sum, counts))  # the layers' shares differ
    # The scheduler frees the blocks the plan leaves: every sub-block lies in the kept blocks of the row,
    # and some layer's heads use another layer's region of them.
    kept_blocks = set(engine.rows["r"][plan.blocks_to_free :])
    regions = set()
    for layer in range(LAYERS):
        for head_subblocks in layer_table(engine.worker, "r", layer).subblocks:
            for subblock in head_subblocks:
                region, block = divmod(subblock // HEADS, NUM_BLOCKS)
                assert block in kept_blocks
                regions.add((layer, region))
    assert any(layer != region for layer, region in regions)
    for generated in range(DECODE):  # each new token lands after every head's kept entries, in every layer
        engine.step([("r", PROMPT, PROMPT + generated, 1, None)])
    new = list(range(PROMPT, PROMPT + DECODE))
    assert [engine.held("r", layer) for layer in range(LAYERS)] == [
        [head + new for head in layer] for layer in expected
    ]
    assert len(engine.rows["r"]) - plan.blocks_to_free <= cdiv(plan.kept_bound + DECODE, BS) + 1


def test_kept_across_layers_keeps_the_plans_total_or_each_layers_newest_on_a_failure() -> None:
    first = torch.tensor([[5.0, 1.0, float("inf")], [0.0, 2.0, 3.0]])
    scores = [first, torch.tensor([[9.0, 8.0, 7.0], [-1.0] * 3])]
    kept = kept_across_layers(scores, (1, 2), heads=2, length=3)  # the 6 best: inf, 9, 8, 7, 5, 3
    assert [k.indices.tolist() for k in kept] == [[[0, 2], [2, -1]], [[0, 1, 2], [-1, -1, -1]]]
    assert [k.counts.tolist() for k in kept] == [[2, 1], [3, 0]]
    fallback = kept_across_layers([scores[0], None], (1, 2), heads=2, length=3)
    assert [k.indices.tolist() for k in fallback] == [[[2], [2]], [[1, 2], [1, 2]]]


def chunked_config(prefill: str, chunk_budget: int) -> EvictionConfig:
    raw = pooled_config().to_dict()
    return EvictionConfig.from_dict({**raw, "prefill": prefill, "chunk_budget": chunk_budget})


@pytest.mark.parametrize(
    ("prefill", "chunk_budget"), [("chunked", BUDGET), ("chunked", 150), ("whole", BUDGET)]
)
def test_a_prompt_in_chunks_holds_what_the_ranking_of_the_whole_prompt_keeps(prefill, chunk_budget) -> None:
    """Evicted between chunks (each a ranking of every layer's held entries, the per-layer rule's total) or
    once after the last chunk, the request ends with the pooled ranking of the whole prompt in every layer and
    head, its pool in the blocks the rule keeps, and decodes after it."""
    engine = TokenKeyedEngine(chunked_config(prefill, chunk_budget))
    plan = engine.worker.plan_for(PROMPT)
    chunk, offsets = 96, []
    for done in range(0, PROMPT, chunk):
        engine.step([("r", PROMPT, done, min(chunk, PROMPT - done), None)])
        held = [engine.held("r", layer) for layer in range(LAYERS)] if done + chunk < PROMPT else None
        if held is not None and plan.prefill_offset(done + chunk):  # evicted between chunks
            offsets.append(plan.prefill_offset(done + chunk))
            counts = [len(head) for layer in held for head in layer]
            assert sum(counts) == LAYERS * HEADS * plan.kept_length_at(done + chunk)
            assert len(set(counts)) > 1  # the layers' and heads' shares differ between chunks too
    assert bool(offsets) == (prefill == "chunked")
    expected = expected_kept(engine)
    assert [engine.held("r", layer) for layer in range(LAYERS)] == expected
    kept_blocks = set(engine.rows["r"][plan.blocks_to_free :])
    for layer in range(LAYERS):
        assert {block % NUM_BLOCKS for block in engine.blocks_read("r", layer)} <= kept_blocks
    for generated in range(4):
        engine.step([("r", PROMPT, PROMPT + generated, 1, None)])
    new = list(range(PROMPT, PROMPT + 4))
    assert [engine.held("r", layer) for layer in range(LAYERS)] == [
        [head + new for head in layer] for layer in expected
    ]
