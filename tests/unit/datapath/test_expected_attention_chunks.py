"""Expected Attention through the datapath: a prompt evicted chunk by chunk is judged with the running
statistics of every prompt query so far (not only the last chunk's and the saved window), with the model's
RoPE frequencies; the statistics go once the prompt is complete."""

from __future__ import annotations

import pytest
import torch
from simulated_engine import DIM, HEADS, LAYERS, SimulatedEngine

from vllm_kvevict.settings.config import EvictionConfig

PROMPT, CHUNK = 400, 96


def run_chunked(engine: SimulatedEngine, req_id: str = "r", stop: int = PROMPT) -> None:
    done = 0
    while done < stop:
        step = min(CHUNK, stop - done)
        engine.step([(req_id, PROMPT, done, step, None)])
        done += step


@pytest.mark.parametrize(
    "method, between",
    [("ada-expected-attention", "window"), ("ada-snapkv", "expected-attention")],
)
def test_every_prompt_query_is_folded_into_the_statistics_across_chunks(method, between) -> None:
    config = EvictionConfig.from_dict(
        {"method": method, "budget": 64, "prefill": "chunked", "chunk_budget": 96, "between": between}
    )
    engine = SimulatedEngine(config)
    engine.worker.chunks.rope_inv_freq = 1.0 / (10_000 ** (torch.arange(0, DIM, 2).float() / DIM))
    run_chunked(engine, stop=288)  # three chunks, none final
    statistics = engine.worker.chunks.statistics["r"]
    assert len(statistics) == LAYERS
    sinks = statistics[0].sinks
    assert all(s.count == 288 - sinks and s.seen == 288 for s in statistics)
    engine.step([("r", PROMPT, 288, PROMPT - 288, None)])  # the last chunk: the method's own budgets
    plan = engine.worker.plan_for(PROMPT)
    for layer in range(LAYERS):
        assert sum(map(len, engine.held("r", layer))) == HEADS * plan.layer_budgets[layer]
    assert "r" not in engine.worker.chunks.statistics  # the prompt is complete: dropped with its last chunk


def test_methods_that_do_not_read_statistics_carry_none() -> None:
    config = EvictionConfig.from_dict(
        {"method": "snapkv", "budget": 64, "prefill": "chunked", "between": "blend"}
    )
    engine = SimulatedEngine(config)
    engine.worker.chunks.rope_inv_freq = torch.ones(DIM // 2)
    run_chunked(engine)
    assert not engine.worker.chunks.statistics
