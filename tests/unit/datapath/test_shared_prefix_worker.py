"""Worker side of prefix caching with eviction: a request that starts from blocks another request published
keeps them whole and unwritten, and evicts only its own part, scored with the shared part in view
(``layout/shared_prefix.py``). ``simulated_engine.SimulatedEngine`` drives the worker as the CPU backend
does; every cached row says which (position, head, layer) it is."""

from __future__ import annotations

import pytest
import torch
from simulated_engine import BS, HEADS, LAYERS, SimulatedEngine, SimulatedRows, part_view, read_rows

from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.layout.shared_prefix import publishable_tokens, spare_blocks
from vllm_kvevict.settings.config import EvictionConfig

PROMPT = 400


def whole_config(method: str, budget: int | float = 0.25, min_freed_share: float = 0.0) -> EvictionConfig:
    """The tests below compact every private part (``min_freed_share`` 0) unless they say otherwise."""
    raw = {"method": method, "budget": budget, "prefill": "whole", "decode": {"method": "none"}}
    return EvictionConfig.from_dict({**raw, "min_freed_share": min_freed_share})


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


def test_a_sharer_whose_part_would_free_too_little_keeps_everything_in_the_standard_layout():
    """Under ``min_freed_share`` the worker plans the sharer's part kept whole, as the scheduler does: nothing
    is scored or moved, and every head reads the whole prompt and its new tokens."""
    engine = SimulatedEngine(whole_config("ada-snapkv", min_freed_share=1.0))
    worker = engine.worker
    engine.step([("owner", PROMPT, 0, PROMPT, None)])
    shared_blocks = publishable_tokens(worker.plan_for(PROMPT), 0) // BS
    shared = shared_blocks * BS
    engine.share_prefix("sharer", "owner", shared_blocks)
    assert worker.plan_for(PROMPT - shared).compacts  # it would compact without the share
    engine.step([("sharer", PROMPT, shared, PROMPT - shared, None)])
    for t in range(2):
        engine.step([("sharer", PROMPT, PROMPT + t, 1, None)])
    assert "sharer" not in worker.requests and "owner" in worker.requests
    rows = engine.rows["sharer"]
    for layer in range(LAYERS):
        keys = part_view(engine.caches[layer], 0)
        for head in range(HEADS):  # sub-block b·H + h of block b: vLLM's own layout
            slots = torch.tensor([(rows[p // BS] * HEADS + head) * BS + p % BS for p in range(PROMPT + 2)])
            assert read_rows(keys, slots)[:, 0].long().tolist() == list(range(PROMPT + 2))


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


def prompt_blocks_as_computed(engine: SimulatedEngine, req_id: str, num_blocks: int) -> bool:
    """Blocks ``[0, num_blocks)`` of ``req_id``'s row hold, in every layer and head, exactly the prompt
    tokens vLLM wrote there (what a later request finding them in the prefix cache reads)."""
    row = engine.rows[req_id]
    for layer in range(LAYERS):
        keys = part_view(engine.caches[layer], 0)
        for block in range(num_blocks):
            for head in range(HEADS):
                rows = keys[row[block] * HEADS + head]
                positions = rows[:, 0].long().tolist()
                if positions != list(range(block * BS, (block + 1) * BS)):
                    return False
                if not (rows[:, 1].eq(head).all() and rows[:, 2].eq(layer).all()):
                    return False
    return True


@pytest.mark.parametrize("method", ["snapkv", "ada-snapkv", "critical-ada-snapkv"])
def test_with_spare_blocks_every_prompt_block_stays_as_computed_for_the_next_request(method):
    """The simulated scheduler gives each request whose prompt completes its plan's spare blocks: the worker
    compacts into them, so the owner's prompt blocks all stay as computed (all published), a sharer starts
    from every one of them and compacts its own part into its spares, and both grow past their spares."""
    engine = SimulatedEngine(whole_config(method), spare_columns=64)
    worker = engine.worker
    engine.step([("owner", PROMPT, 0, PROMPT, None)])
    plan = worker.plan_for(PROMPT)
    n, k = cdiv(PROMPT, BS), spare_blocks(plan)
    assert engine.spares["owner"] == k > 0 and len(engine.rows["owner"]) == n + k
    assert publishable_tokens(plan, 0, k) == PROMPT and PROMPT % BS == 0
    assert prompt_blocks_as_computed(engine, "owner", n)
    owner_spares = set(engine.rows["owner"][n:])
    for layer in range(LAYERS):
        assert engine.blocks_read("owner", layer) <= owner_spares
        held = engine.held("owner", layer)
        assert sum(len(head) for head in held) == HEADS * plan.layer_budgets[layer]
        for head in held:
            assert head == sorted(set(head)) and PROMPT - 1 in head

    sharer_prompt = 2 * PROMPT
    engine.share_prefix("sharer", "owner", n)  # the whole prompt of the owner: every block was published
    engine.step([("owner", PROMPT, PROMPT, 1, None), ("sharer", sharer_prompt, PROMPT, PROMPT, None)])
    assert worker.shared_tokens["sharer"] == PROMPT
    private = worker.plan_for(sharer_prompt - PROMPT)
    assert private.compacts and engine.spares["sharer"] == spare_blocks(private)
    assert prompt_blocks_as_computed(engine, "owner", n)  # the sharer read them and wrote none
    sharer_row = engine.rows["sharer"]
    assert prompt_blocks_as_computed(engine, "sharer", cdiv(sharer_prompt, BS))  # its own blocks too
    own_spares = set(sharer_row[cdiv(sharer_prompt, BS) :])
    for layer in range(LAYERS):
        assert engine.blocks_read("sharer", layer) <= set(sharer_row[:n]) | own_spares
        for head in engine.held("sharer", layer):
            assert head[:PROMPT] == list(range(PROMPT))
            assert all(PROMPT <= p < sharer_prompt for p in head[PROMPT:])

    for t in range(BS + 2):  # decoding past the spares: the rows grow by position, shifted by the spares
        owner_step = ("owner", PROMPT, PROMPT + 1 + t, 1, None)
        engine.step([owner_step, ("sharer", sharer_prompt, sharer_prompt + t, 1, None)])
    for layer in range(LAYERS):
        for head in engine.held("owner", layer):
            assert head[-(BS + 3) :] == list(range(PROMPT, PROMPT + BS + 3))
        for head in engine.held("sharer", layer):
            assert head[:PROMPT] == list(range(PROMPT))
            assert head[-(BS + 2) :] == list(range(sharer_prompt, sharer_prompt + BS + 2))
    assert prompt_blocks_as_computed(engine, "owner", n)
