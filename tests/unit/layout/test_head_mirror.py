"""The head-major block tables the kernels read (``SubBlockStore.block_tables``, a mirror patched where the
tables changed) equal a head-major copy built fresh from the tables after every kind of change: decode
growth, a compaction, a new request, a finished request, requests moving slots at an unchanged batch size.

A stale mirror would hand the attention sub-blocks a head no longer holds, so each check compares every
column a head of the step's longest sequence may use, and the steady steps also check that the mirror was
reused (patched in place), so the comparison covers the incremental path and not only rebuilds.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.unit.layout.test_batch_tables import Simulation
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.subblock_store import SubBlockStore


def fresh_head_major(store: SubBlockStore, num_slots: int, width: int) -> torch.Tensor:
    """[G, H * R, width] the head-major tables built from scratch (what ``block_tables`` once copied)."""
    tables = store.tables[:, :num_slots, :, :width].transpose(1, 2)
    return tables.reshape(store.num_groups, store.num_kv_heads * num_slots, width)


def check_mirror(store: SubBlockStore, num_slots: int, max_len: int) -> torch.Tensor:
    got = store.block_tables(num_slots, max_len)
    width = max(1, min(store.width, cdiv(max_len, store.block_size)))
    assert got.shape[:2] == (store.num_groups, store.num_kv_heads * num_slots) and got.shape[2] >= width
    assert got.is_contiguous()
    assert torch.equal(got[:, :, :width], fresh_head_major(store, num_slots, width))
    return got


class CheckedSimulation(Simulation):
    """``Simulation`` whose every decode step also reads the kernels' head-major tables."""

    reused = 0  # steps whose tables were the previous step's mirror, patched

    def decode(self, req_ids: list[str], q_lens: list[int]) -> None:
        super().decode(req_ids, q_lens)
        store = self.tables.store
        before = store._mirror.table
        got = check_mirror(store, len(req_ids), max(self.lengths[r] for r in req_ids))
        if before is not None and got.data_ptr() == before.data_ptr():
            self.reused += 1


@pytest.mark.parametrize("shared,check", [(True, True), (False, True), (False, False)])
def test_block_tables_equal_a_fresh_head_major_copy_through_batch_changes(shared: bool, check: bool) -> None:
    rng = random.Random(3)
    bs, heads = 16, 4
    sim = CheckedSimulation(rng, heads, bs, shared, check)
    method = "snapkv" if shared else "ada-snapkv"
    sim.prefill(["a", "b", "c"], [7 * bs + 5, 5 * bs + 3, bs // 2], 2 * bs, method)
    for _ in range(2 * bs + 3):  # steady decode: every head crosses sub-block boundaries
        sim.decode(["a", "b", "c"], [1, 1, 1])
    if check:  # the CPU path patches the mirror; the dense (GPU) path rebuilds it every step
        assert sim.reused >= 2 * bs
    # A new request "d" takes finished "c"'s slot: same batch size, other rows.
    sim.prefill(["d"], [6 * bs + 1], 2 * bs, method)
    sim.tables.forget("c")
    for _ in range(bs + 1):
        sim.decode(["a", "b", "d"], [1, 1, 1])
    # Requests swap slots (vLLM condensing its batch), then one finishes and the batch shrinks.
    sim.decode(["b", "a", "d"], [1, 1, 1])
    sim.decode(["b", "a", "d"], [1, 2, 1])
    sim.tables.forget("a")
    for _ in range(bs + 1):
        sim.decode(["b", "d"], [1, 1])


@pytest.mark.parametrize("shared", [True, False])
def test_block_tables_follow_a_compaction_at_an_unchanged_batch_size(shared: bool) -> None:
    """A request compacted while the batch keeps its size (its slot's rows are replaced by a commit)."""
    layers, heads, bs = 3, 2, 16
    tables = BatchSubBlocks(layers, heads, bs, shared)
    rows = torch.tensor([[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 11, 0, 0]], dtype=torch.int32)
    lengths = np.array([4 * bs, 5 * bs + 3])
    store = tables.begin(["a", "b"], np.zeros(2, dtype=np.int64), rows)
    tables.skip(2)
    for _ in range(3):
        store = tables.begin(["a", "b"], lengths, rows)
        tables.layout(lengths, np.ones(2, dtype=np.int64), rows, check=True)
        lengths += 1
        check_mirror(store, 2, int(lengths.max()))
    # Compact "b" (slot 1): its heads keep 20 and 30 tokens in two sub-blocks each, in every group.
    table = store.assign(torch.tensor([20, 30]), rows[1], 2, 0, 50, 6, True)
    for layer in range(layers):
        if tables.last_layer_of_group(layer):
            tables.commit(layer, 1, table, 2)
    tables.mark_compacted(1)
    got = check_mirror(store, 2, int(lengths.max()))
    for group in range(store.num_groups):  # sequence h*2 + 1 is head h of "b"
        assert torch.equal(got[group, 1::2, :2], table.rows[:, :2])
    for _ in range(bs + 2):
        store = tables.begin(["a", "b"], lengths, rows)
        tables.layout(lengths, np.ones(2, dtype=np.int64), rows, check=True)
        lengths += 1
        check_mirror(store, 2, int(lengths.max()))
