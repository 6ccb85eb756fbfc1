"""Through the worker's datapath (``simulated_engine``): a prompt evicted chunk by chunk with the learned
scorer ends with the same entries in every head and layer as the same prompt evicted once whole, wherever the
intermediate budget allows it (kvzap: at least the final budget; ada-kvzap, uniform between chunks and
ragged at the end: at least the largest head's budget)."""

from __future__ import annotations

import pytest
import torch
from simulated_engine import DIM, HEADS, LAYERS, SimulatedEngine

from vllm_kvevict.settings.config import EvictionConfig

PROMPT, CHUNK, BUDGET = 400, 96, 64


class TokenKeyedEngine(SimulatedEngine):
    """Each token's key and value are a function of (position, layer) alone, the same in every run however
    its prompt is cut into steps (the base engine draws them in step order)."""

    def __init__(self, config: EvictionConfig) -> None:
        super().__init__(config)
        g = torch.Generator().manual_seed(1)
        self.token_keys = [torch.randn(PROMPT, HEADS, DIM, generator=g) * 300 for _ in range(LAYERS)]

    def tokens(self, positions: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, _ = super().tokens(positions, layer)  # the (position, head, layer) marks
        key[:, :, 3:] = self.token_keys[layer][positions][:, :, 3:]
        return query, key, -key


def held_after(config: EvictionConfig, chunk: int) -> list[list[list[int]]]:
    """Per layer, per head, the positions held once the prompt is computed in steps of ``chunk``."""
    engine = TokenKeyedEngine(config)
    for done in range(0, PROMPT, chunk):
        engine.step([("r", PROMPT, done, min(chunk, PROMPT - done), None)])
    return [engine.held("r", layer) for layer in range(LAYERS)]


def config(method: str, prefill: str, chunk_budget: int = BUDGET) -> EvictionConfig:
    return EvictionConfig.from_dict(
        {
            "method": method,
            "budget": BUDGET,
            "params": {"window": 8, "sinks": 2},
            "prefill": prefill,
            "chunk_budget": chunk_budget,
            "decode": {"method": "none"},
        }
    )


@pytest.mark.parametrize(
    ("method", "chunk_budget"), [("kvzap", BUDGET), ("kvzap", 96), ("ada-kvzap", HEADS * BUDGET)]
)
def test_chunk_by_chunk_holds_what_the_whole_prompt_keeps(method: str, chunk_budget: int) -> None:
    chunked = config(method, "chunked", chunk_budget)
    plan = TokenKeyedEngine(chunked).worker.plan_for(PROMPT)
    assert plan.prefill_offset(288) > 0 and plan.prefill_offset(384) > 0  # it does evict between chunks
    whole = held_after(config(method, "whole"), PROMPT)
    assert held_after(chunked, CHUNK) == whole
    if method == "ada-kvzap":
        assert len({len(head) for layer in whole for head in layer}) > 1  # ragged: Ada-KV's allocation
