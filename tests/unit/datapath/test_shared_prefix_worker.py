"""Worker side of prefix caching with eviction: a request that starts from blocks another request published
keeps them whole and unwritten, and evicts only its own part, scored with the shared part in view
(``layout/shared_prefix.py``). ``simulated_engine.SimulatedEngine`` drives the worker as the CPU backend
does; every cached row says which (position, head, layer) it is."""

from __future__ import annotations

import pytest
import torch
from simulated_engine import BS, HEADS, LAYERS, SimulatedEngine, SimulatedRows

from vllm_kvevict.layout.shared_prefix import publishable_tokens
from vllm_kvevict.settings.config import EvictionConfig

PROMPT = 400


def whole_config(method: str, budget: int | float = 0.25) -> EvictionConfig:
    return EvictionConfig.from_dict(
        {"method": method, "budget": budget, "prefill": "whole", "decode": {"method": "none"}}
    )


@pytest.mark.parametrize(
    "method", ["snapkv", "ada-snapkv", "pyramidkv", "critical-ada-snapkv", "nacl", "keydiff"]
)
def test_a_request_on_a_shared_prefix_keeps_it_whole_and_evicts_only_its_own_part(method):
    engine = SimulatedEngine(whole_config(method))
    worker = engine.worker
    engine.step([("owner", PROMPT, 0, PROMPT, None)])
    owner_plan = worker.plan_for(PROMPT)
    published = publishable_tokens(owner_plan, 0)
    assert owner_plan.compacts and published == owner_plan.blocks_to_free * BS
    shared_blocks = published // BS
    shared = shared_blocks * BS
    owner_held = [engine.held("owner", layer) for layer in range(LAYERS)]

    engine.share_prefix("sharer", "owner", shared_blocks)
    prefix_rows = engine.rows["sharer"][:shared_blocks]
    before = [cache[prefix_rows].clone() for cache in engine.caches]
    # The owner decodes in the same batch while the sharer computes the rest of its prompt.
    engine.step([("owner", PROMPT, PROMPT, 1, None), ("sharer", PROMPT, shared, PROMPT - shared, None)])

    assert worker.shared_tokens["sharer"] == shared and worker.shared_tokens["owner"] == 0
    private = worker.plan_for(PROMPT - shared)
    assert private.compacts
    freed = set(engine.rows["sharer"][shared_blocks : shared_blocks + private.blocks_to_free])
    for layer in range(LAYERS):
        assert torch.equal(engine.caches[layer][prefix_rows], before[layer]), "a shared block was written"
        held = engine.held("sharer", layer)
        own = 0
        for head in held:
            assert head[:shared] == list(range(shared))
            rest = head[shared:]
            assert rest == sorted(set(rest)) and all(shared <= p < PROMPT for p in rest)
            assert PROMPT - 1 in rest  # the newest entry (the end of the observation window)
            own += len(rest)
        assert own == HEADS * private.layer_budgets[layer]
        assert not engine.blocks_read("sharer", layer) & freed
        assert engine.held("owner", layer) == [h + [PROMPT] for h in owner_held[layer]]

    for t in range(BS + 2):  # decoding crosses into a new block of the sharer's own pool
        engine.step([("sharer", PROMPT, PROMPT + t, 1, None)])
    for layer in range(LAYERS):
        for head in engine.held("sharer", layer):
            assert head[:shared] == list(range(shared))
            assert head[-(BS + 2) :] == list(range(PROMPT, PROMPT + BS + 2))
        assert not engine.blocks_read("sharer", layer) & freed


@pytest.mark.parametrize(("method", "reads_values"), [("ada-snapkv", False), ("critical-ada-snapkv", True)])
def test_a_sharer_reads_values_back_only_for_a_method_that_weighs_by_them(method, reads_values, monkeypatch):
    """The re-score reads the held keys back from the cache, and the values only when the method reads
    them (``policies.base.reads_values``): SnapKV-style scores need none, CriticalKV's ||V W_O|| does."""
    engine = SimulatedEngine(whole_config(method))
    engine.step([("owner", PROMPT, 0, PROMPT, None)])
    shared_blocks = publishable_tokens(engine.worker.plan_for(PROMPT), 0) // BS
    engine.share_prefix("sharer", "owner", shared_blocks)
    reads: list[str] = []
    read, read_keys = SimulatedRows.read, SimulatedRows.read_keys

    def counted_read(rows: SimulatedRows, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        reads.append("keys+values")
        return read(rows, slots)

    def counted_read_keys(rows: SimulatedRows, slots: torch.Tensor) -> torch.Tensor:
        reads.append("keys")
        return read_keys(rows, slots)

    monkeypatch.setattr(SimulatedRows, "read", counted_read)
    monkeypatch.setattr(SimulatedRows, "read_keys", counted_read_keys)
    engine.step([("sharer", PROMPT, shared_blocks * BS, PROMPT - shared_blocks * BS, None)])
    assert engine.worker.shared_tokens["sharer"] == shared_blocks * BS
    assert reads == ["keys+values" if reads_values else "keys"] * LAYERS


def test_private_part_within_budget_reads_the_prefix_in_the_standard_layout():
    """A sharer whose own part is within the budget keeps everything: no table, vLLM's layout."""
    engine = SimulatedEngine(whole_config("ada-snapkv", budget=96))
    engine.step([("owner", PROMPT, 0, PROMPT, None)])
    shared_blocks = publishable_tokens(engine.worker.plan_for(PROMPT), 0) // BS
    engine.share_prefix("sharer", "owner", shared_blocks)
    shared = shared_blocks * BS
    assert not engine.worker.plan_for(PROMPT - shared).compacts
    engine.step([("sharer", PROMPT, shared, PROMPT - shared, None)])
    assert "sharer" not in engine.worker.requests
    assert not engine.worker.tables.compacted(1)[0]


def test_finished_sharer_leaves_no_shared_prefix_state():
    engine = SimulatedEngine(whole_config("snapkv"))
    engine.step([("owner", PROMPT, 0, PROMPT, None)])
    engine.share_prefix("sharer", "owner", 4)
    engine.step([("sharer", PROMPT, 4 * BS, PROMPT - 4 * BS, None)])
    engine.worker.drop(["sharer", "owner"])
    assert not engine.worker.shared_tokens
