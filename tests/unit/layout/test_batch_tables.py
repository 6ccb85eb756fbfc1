"""The tensor sub-block tables (``BatchSubBlocks`` / ``SubBlockStore``) against the reference model
(``RequestSubBlocks`` / ``SubBlockTable``) over the whole life of several requests in one batch.

vLLM is simulated as in ``test_subblock_table.py``: the prompt gets ceil(P/bs) blocks, the scheduler frees
blocks [0, s) after it, and a request gets a new block when its length needs one. Each step schedules a
random subset of the requests in a random order (vLLM's batch changes slots when requests come and go), with
one token each or, sometimes, several; some requests never compact (prompt within budget) and stay in the
standard layout beside the compacted ones.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from layout_cases import block_table_of, ragged_counts

from tests.unit.layout.subblock_reference import RequestSubBlocks, SubBlockPoolExhausted
from vllm_kvevict.layout.accounting import cdiv, plan_request
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.policies.registry import build_policy

LAYERS = 4


class Simulation:
    """Requests, their vLLM block rows, the reference tables and the tensor tables side by side."""

    def __init__(self, rng: random.Random, heads: int, block_size: int, shared: bool, check: bool) -> None:
        self.rng, self.heads, self.bs, self.check, self.shared = rng, heads, block_size, check, shared
        self.tables = BatchSubBlocks(LAYERS, heads, block_size, shared, capacity=2)
        self.next_block = itertools.count(1)  # 0 is vLLM's null block
        self.rows: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}  # tokens computed so far
        self.reference: dict[str, RequestSubBlocks] = {}
        self.width = 64

    def block_table(self, req_ids: list[str]) -> torch.Tensor:
        return block_table_of(self.rows, req_ids, self.width)

    def prefill(
        self, req_ids: list[str], prompts: list[int], budget: int | float, method: str, trailing: int = 0
    ) -> None:
        """One step computing every prompt (and ``trailing`` tokens after it, as a request recomputed after
        preemption does); compacting requests are compacted layer by layer."""
        for req_id, prompt in zip(req_ids, prompts, strict=True):
            self.rows[req_id] = [next(self.next_block) for _ in range(cdiv(prompt + trailing, self.bs))]
            self.lengths[req_id] = prompt + trailing
        table = self.block_table(req_ids)
        store = self.tables.begin(req_ids, np.zeros(len(req_ids), dtype=np.int64), table)
        self.tables.skip(len(req_ids))
        policy = build_policy(method)
        for slot, (req_id, prompt) in enumerate(zip(req_ids, prompts, strict=True)):
            plan = plan_request(prompt, budget, self.bs, policy, LAYERS)
            if not plan.compacts:
                continue
            kept_row = self.rows[req_id][plan.blocks_to_free :]
            reference = RequestSubBlocks(LAYERS, self.heads, self.bs, plan.blocks_to_free, kept_row)
            pending = None
            for layer, layer_budget in enumerate(plan.layer_budgets):
                if self.shared:
                    counts = [layer_budget] * self.heads
                else:
                    counts = ragged_counts(self.heads * layer_budget, self.heads, prompt, self.rng)
                reference.compact_layer(layer, counts, trailing)
                if pending is None or not self.shared:
                    pending = store.assign(
                        torch.tensor(counts),
                        table[slot],
                        plan.blocks_to_free,
                        trailing,
                        sum(counts),
                        cdiv(prompt + trailing, self.bs),
                        self.check,
                    )
                if self.tables.last_layer_of_group(layer):
                    self.tables.commit(layer, slot, pending, plan.blocks_to_free)
            self.tables.mark_compacted(slot)
            self.rows[req_id][: plan.blocks_to_free] = [0] * plan.blocks_to_free  # freed by the scheduler
            self.reference[req_id] = reference

    def decode(self, req_ids: list[str], q_lens: list[int]) -> None:
        """One step: each request computes q tokens; the tensor tables must equal the reference."""
        computed = np.array([self.lengths[r] for r in req_ids], dtype=np.int64)
        for req_id, q in zip(req_ids, q_lens, strict=True):
            self.lengths[req_id] += q
            while len(self.rows[req_id]) < cdiv(self.lengths[req_id], self.bs):
                self.rows[req_id].append(next(self.next_block))
        table = self.block_table(req_ids)
        store = self.tables.begin(req_ids, computed, table)
        assert self.tables.compacted(len(req_ids)).tolist() == [r in self.reference for r in req_ids]
        layout = self.tables.layout(computed, np.array(q_lens, dtype=np.int64), table, self.check)
        expected_slots = []
        for req_id, q in zip(req_ids, q_lens, strict=True):
            reference = self.reference.get(req_id)
            if reference is not None:
                reference.sync_blocks(self.rows[req_id], cdiv(self.lengths[req_id], self.bs))
                expected_slots.append(reference.append(q))
        t0 = 0
        for slot, (req_id, q) in enumerate(zip(req_ids, q_lens, strict=True)):
            reference = self.reference.get(req_id)
            for layer in range(LAYERS):
                group = self.tables.group_of(layer)
                lengths = store.lengths[group, slot].tolist()
                rows = store.tables[group, slot].tolist()
                slots = layout.token_slots[group, t0 : t0 + q]
                if reference is None:  # standard layout: sub-block block*H + h, full length
                    assert lengths == [self.lengths[req_id]] * self.heads
                    n = cdiv(self.lengths[req_id], self.bs)
                    for h in range(self.heads):
                        assert rows[h][:n] == [b * self.heads + h for b in self.rows[req_id][:n]]
                    positions = torch.arange(self.lengths[req_id] - q, self.lengths[req_id])
                    blocks = torch.tensor(self.rows[req_id])[positions // self.bs]
                    want = (blocks[:, None] * self.heads + torch.arange(self.heads)) * self.bs
                    assert torch.equal(slots, want + (positions % self.bs)[:, None])
                    continue
                ref_table = reference.layer_tables[layer]
                assert lengths == ref_table.lengths
                for h in range(self.heads):
                    assert rows[h][: len(ref_table.subblocks[h])] == ref_table.subblocks[h]
                ref_slots = torch.stack([ref_table.head_slots(h)[-q:] for h in range(self.heads)], dim=1)
                assert torch.equal(slots, ref_slots)
            t0 += q
        # Head-major sequences: sequence h*R + r is request r's tokens for head h, at rows h*T + t of the
        # query regrouped [H*T, g, D] (the tokens are in request order).
        tokens, starts = sum(q_lens), layout.query_start_loc.tolist()
        assert starts[-1] == tokens * self.heads
        sequence = 0
        for h in range(self.heads):
            t0 = 0
            for q in q_lens:
                assert starts[sequence] == h * tokens + t0 and starts[sequence + 1] - starts[sequence] == q
                t0 += q
                sequence += 1


@pytest.mark.parametrize("seed", range(24))
def test_tensor_tables_match_the_reference_model_through_batch_changes(seed: int) -> None:
    rng = random.Random(seed)
    heads = rng.choice([1, 2, 3, 8])
    block_size = rng.choice([16, 32, 48])  # 48: a block size that is not a power of two
    shared = rng.random() < 0.3
    sim = Simulation(rng, heads, block_size, shared, check=seed % 2 == 0)  # sparse (CPU) and dense paths
    method = "snapkv" if shared else "ada-snapkv"
    req_ids = [f"r{i}" for i in range(rng.randint(2, 5))]
    prompts = [rng.randint(block_size + 1, 10 * block_size) for _ in req_ids]
    prompts[0] = 6 * block_size + 5  # at least one request compacts at budget 2*bs...
    prompts[-1] = block_size // 2  # ...and one stays in the standard layout
    sim.prefill(req_ids, prompts, 2 * block_size, method, trailing=rng.choice([0, 0, 3, block_size + 1]))
    for _ in range(rng.randint(block_size, 3 * block_size)):
        batch = rng.sample(req_ids, rng.randint(1, len(req_ids)))
        q_lens = [1 if rng.random() < 0.85 else rng.randint(2, block_size + 3) for _ in batch]
        sim.decode(batch, q_lens)


def test_splitting_a_shared_store_keeps_every_layer_reading_the_same_rows() -> None:
    rng = random.Random(7)
    sim = Simulation(rng, 3, 16, shared=True, check=True)
    sim.prefill(["a", "b"], [200, 150], 32, "snapkv")
    sim.decode(["a", "b"], [1, 1])
    sim.decode(["b"], [1])  # "a" leaves the batch: its rows are saved
    sim.tables.split()
    assert sim.tables.store.num_groups == LAYERS
    sim.shared = False
    sim.decode(["a", "b"], [1, 1])  # "a" comes back with rows for every group


def test_a_dry_pool_is_an_error_naming_the_rule() -> None:
    tables = BatchSubBlocks(1, 2, 16, shared=False)
    block_table = torch.tensor([[5, 6, 0, 0]], dtype=torch.int32)
    store = tables.begin(["a"], np.array([0]), block_table)
    # 33 kept tokens need three sub-blocks; the one kept block (6) has two.
    with pytest.raises(SubBlockPoolExhausted, match="accounting rule"):
        store.assign(torch.tensor([16, 17]), block_table[0], 1, 0, 33, 2, True)
    table = store.assign(torch.tensor([16, 16]), block_table[0], 1, 0, 32, 2, True)
    tables.commit(0, 0, table, 1)
    tables.mark_compacted(0)
    # A step that leaves the request no new block (seq_len 16 -> one block) while both heads are full.
    tables.begin(["a"], np.array([15]), block_table)
    with pytest.raises(SubBlockPoolExhausted, match="accounting rule"):
        tables.layout(np.array([15]), np.array([1]), block_table, check=True)
