"""A shared prefix's rows are read once per layer and step for every request of the step that holds them
(``datapath/shared_reads.py``), and every request still gets exactly the rows it holds."""

from __future__ import annotations

import pytest
import torch
from simulated_engine import BS, HEADS, LAYERS, SimulatedEngine, SimulatedRows

from vllm_kvevict.datapath.shared_reads import HeldReads
from vllm_kvevict.layout.shared_prefix import publishable_tokens
from vllm_kvevict.settings.config import EvictionConfig

DIM, SUBBLOCKS = 4, 40


class CountingRows:
    """Cache rows of a [SUBBLOCKS * BS, 2, D] tensor; counts the rows each call reads."""

    def __init__(self) -> None:
        self.cache = torch.randn(SUBBLOCKS * BS, 2, DIM)
        self.rows_read: list[int] = []

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.rows_read.append(slots.numel())
        rows = self.cache[slots.reshape(-1)]
        return rows[:, 0], rows[:, 1]

    def read_keys(self, slots: torch.Tensor) -> torch.Tensor:
        self.rows_read.append(slots.numel())
        return self.cache[slots.reshape(-1), 0]


def head_slots(subblocks: list[list[int]], length: int) -> torch.Tensor:
    """[H, length] slots of the first ``length`` rows of each head's sub-blocks."""
    j = torch.arange(length)
    return torch.stack([torch.tensor(row)[j // BS] * BS + j % BS for row in subblocks])


def expected(rows: CountingRows, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    picked = rows.cache[slots]
    return picked[..., 0, :], picked[..., 1, :]


@pytest.mark.parametrize("with_values", [False, True])
def test_requests_on_one_prefix_read_its_rows_once(with_values):
    rows = CountingRows()
    reads = HeldReads(rows)
    prefix = [[0, 1, 2], [10, 11, 12]]  # 2 heads, 3 shared sub-blocks each
    first = head_slots([p + [3, 4] for p in prefix], 4 * BS + 5)
    second = head_slots([p + [20, 21] for p in prefix], 3 * BS + 7)
    for slots in (first, second):
        keys, values = reads.read(slots, 3 * BS, with_values)
        want_keys, want_values = expected(rows, slots)
        assert torch.equal(keys, want_keys)
        assert torch.equal(values, want_values) if with_values else values is None
    assert rows.rows_read == [first.numel(), 2 * 7]  # the second read only its own 7 rows per head


def test_a_different_prefix_or_missing_values_are_read_again():
    rows = CountingRows()
    reads = HeldReads(rows)
    shared = 2 * BS
    first = head_slots([[0, 1, 3], [10, 11, 13]], 2 * BS + 4)
    other_prefix = head_slots([[0, 2, 4], [10, 12, 14]], 2 * BS + 4)
    reads.read(first, shared, with_values=False)
    reads.read(other_prefix, shared, with_values=False)  # block 2 is not block 1: a different prefix
    keys, values = reads.read(first, shared, with_values=True)  # read keys only before: values are needed
    assert rows.rows_read == [first.numel()] * 3
    assert torch.equal(keys, expected(rows, first)[0]) and torch.equal(values, expected(rows, first)[1])
    keys, _ = reads.read(first[:, :shared], shared, with_values=False)  # holds only the prefix
    assert rows.rows_read == [first.numel()] * 3 and torch.equal(keys, expected(rows, first[:, :shared])[0])


def test_without_a_shared_prefix_every_request_reads_all_it_holds():
    rows = CountingRows()
    reads = HeldReads(rows)
    slots = head_slots([[0, 1], [10, 11]], BS + 3)
    for _ in range(2):
        keys, _ = reads.read(slots, 0, with_values=False)
        assert torch.equal(keys, expected(rows, slots)[0])
    assert rows.rows_read == [slots.numel()] * 2


PROMPT = 400


@pytest.mark.parametrize("method", ["ada-snapkv", "critical-ada-snapkv"])
def test_two_sharers_in_one_step_keep_what_they_keep_when_each_reads_everything(method, monkeypatch):
    """Two requests on one prefix re-scored in the same step: the prefix rows are read once per layer, and
    both keep exactly the entries they keep when every request reads all it holds."""
    config = EvictionConfig.from_dict(
        {"method": method, "budget": 0.25, "prefill": "whole", "decode": {"method": "none"}}
    )

    def run() -> tuple[list[list[list[int]]], list[int]]:
        engine = SimulatedEngine(config)
        engine.step([("owner", PROMPT, 0, PROMPT, None)])
        shared_blocks = publishable_tokens(engine.worker.plan_for(PROMPT), 0) // BS
        shared = shared_blocks * BS
        for sharer in ("a", "b"):
            engine.share_prefix(sharer, "owner", shared_blocks)
        read_sizes: list[int] = []
        read, read_keys = SimulatedRows.read, SimulatedRows.read_keys

        def counted_read(rows: SimulatedRows, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            read_sizes.append(slots.numel())
            return read(rows, slots)

        def counted_read_keys(rows: SimulatedRows, slots: torch.Tensor) -> torch.Tensor:
            read_sizes.append(slots.numel())
            return read_keys(rows, slots)

        monkeypatch.setattr(SimulatedRows, "read", counted_read)
        monkeypatch.setattr(SimulatedRows, "read_keys", counted_read_keys)
        engine.step([(s, PROMPT, shared, PROMPT - shared, None) for s in ("a", "b")])
        monkeypatch.undo()
        assert engine.worker.shared_tokens["b"] == shared
        held = [engine.held(s, layer) for s in ("a", "b") for layer in range(LAYERS)]
        return held, read_sizes

    held, read_sizes = run()
    own = PROMPT - publishable_tokens(SimulatedEngine(config).worker.plan_for(PROMPT), 0)
    assert read_sizes == [HEADS * PROMPT, HEADS * own] * LAYERS
    monkeypatch.setattr(HeldReads, "_find", lambda self, slots, with_values: None)
    held_reading_all, read_sizes = run()
    assert read_sizes == [HEADS * PROMPT] * 2 * LAYERS
    assert held == held_reading_all
