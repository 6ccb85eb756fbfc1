"""Through the worker's datapath (``simulated_engine``): KVzap's threshold mode (an adaptive plan). Each layer
keeps what its scores put above the threshold, at most H x the budget; its entries start at the first block
its own bound leaves; the worker reports the largest layer's bound for the scheduler; and once the scheduler
has freed the blocks that bound leaves, every layer still reads only its own entries while decoding."""

from __future__ import annotations

import pytest
import torch
from simulated_engine import BS, HEADS, LAYERS, SimulatedEngine

from vllm_kvevict.layout.accounting import first_block_for_bound, layer_kept_bound
from vllm_kvevict.policies.base import LayerKV
from vllm_kvevict.settings.config import EvictionConfig

PROMPT, BUDGET, DECODE = 400, 160, 40


class TokenKeyedEngine(SimulatedEngine):
    """Keys and values of a token depend on (position, layer) alone, with a scale that differs by layer, so
    the scores (and the counts above the threshold) differ by layer."""

    def __init__(self, config: EvictionConfig) -> None:
        super().__init__(config)
        g = torch.Generator().manual_seed(3)
        self.token_keys = [
            torch.randn(PROMPT + DECODE, HEADS, 8, generator=g) * (50 + 150 * layer)
            for layer in range(LAYERS)
        ]

    def tokens(self, positions: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, _ = super().tokens(positions, layer)  # the (position, head, layer) marks
        key[:, :, 3:] = self.token_keys[layer][positions][:, :, 3:]
        return query, key, -key


def threshold_config(tau: float) -> EvictionConfig:
    return EvictionConfig.from_dict(
        {"method": "kvzap", "budget": BUDGET, "params": {"window": 8, "sinks": 2, "threshold": tau}}
    )


def prompt_layer(engine: TokenKeyedEngine, layer: int) -> LayerKV:
    """The prompt's rows in ``layer`` as the engine writes them, as a policy reads them (no queries)."""
    _, key, value = engine.tokens(torch.arange(PROMPT), layer)
    return LayerKV(
        keys=key.transpose(0, 1),
        values=value.transpose(0, 1),
        queries=torch.zeros(HEADS, 0, key.shape[2]),
        layer_idx=layer,
        num_layers=LAYERS,
    )


def expected_kept(engine: TokenKeyedEngine, layer: int) -> list[list[int]]:
    """What the policy keeps of the prompt in ``layer``, per head."""
    kept = engine.worker.policy.select(prompt_layer(engine, layer), BUDGET)
    return [kept.head(h).tolist() for h in range(HEADS)]


def threshold_between_layers(engine: TokenKeyedEngine) -> float:
    """The largest of the layers' 75th score percentiles: every layer keeps at most about a quarter of its
    entries (below the ceiling), and the layers, whose scores differ in level, keep different counts."""
    policy = engine.worker.policy
    return max(
        float(policy.entry_scores(prompt_layer(engine, layer)).flatten().quantile(0.75))
        for layer in range(LAYERS)
    )


@pytest.fixture
def compacted() -> tuple[TokenKeyedEngine, float]:
    tau = threshold_between_layers(TokenKeyedEngine(threshold_config(0.0)))
    engine = TokenKeyedEngine(threshold_config(tau))
    engine.step([("r", PROMPT, 0, PROMPT, None)])
    return engine, tau


def test_each_layer_keeps_what_scores_above_the_threshold_under_the_ceiling(compacted) -> None:
    engine, _ = compacted
    totals = []
    for layer in range(LAYERS):
        expected = expected_kept(engine, layer)
        assert [sorted(head) for head in engine.held("r", layer)] == expected
        totals.append(sum(map(len, expected)))
    assert len(set(totals)) > 1  # the scores, not the budget, set each layer's count
    assert min(totals) < HEADS * BUDGET and max(totals) <= HEADS * BUDGET


def test_the_worker_reports_its_largest_layers_bound_and_writes_each_layer_after_its_own(compacted) -> None:
    engine, _ = compacted
    worker = engine.worker
    bounds = worker.records.take_kept_bounds()
    assert worker.records.take_kept_bounds() == {}  # reported once
    ceiling = worker.plan_for(PROMPT)
    assert ceiling.adaptive and ceiling.compacts
    layer_bounds, firsts = [], []
    for layer in range(LAYERS):
        total = sum(map(len, engine.held("r", layer)))
        bound = layer_kept_bound(PROMPT, total, HEADS, BS)
        layer_bounds.append(bound)
        first = first_block_for_bound(PROMPT, bound, BS)
        firsts.append(first)
        row = engine.rows["r"]
        assert min(row.index(block) for block in engine.blocks_read("r", layer)) >= first
    assert len(set(firsts)) > 1  # layers start their entries at different blocks
    assert bounds == {"r": max(layer_bounds)}
    assert bounds["r"] < ceiling.kept_bound  # the scheduler frees more than the ceiling's blocks
    assert worker.records.requests["r"].blocks_to_free == first_block_for_bound(PROMPT, bounds["r"], BS)


def test_decoding_after_the_scheduler_freed_the_reported_blocks_reads_only_kept_entries(compacted) -> None:
    engine, _ = compacted
    freed = engine.worker.records.requests["r"].blocks_to_free
    kept = [[sorted(head) for head in engine.held("r", layer)] for layer in range(LAYERS)]
    engine.rows["r"][:freed] = [0] * freed  # the scheduler's remove_skipped_blocks: null blocks
    for t in range(DECODE):
        engine.step([("r", PROMPT, PROMPT + t, 1, None)])
    new = list(range(PROMPT, PROMPT + DECODE))
    for layer in range(LAYERS):
        assert [sorted(head) for head in engine.held("r", layer)] == [head + new for head in kept[layer]]
        assert 0 not in engine.blocks_read("r", layer)
