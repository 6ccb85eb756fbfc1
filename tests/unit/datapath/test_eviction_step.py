"""The worker's per-step orchestration without a server: which requests compact, where their kept entries
and new tokens go, and what the head-as-sequence view of a mixed batch looks like."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.layout.subblock_reference import layer_table
from vllm_kvevict.datapath.worker import EvictionWorker, StepInputs
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.policies.registry import available_methods, build_policy
from vllm_kvevict.settings.config import EvictionConfig

HEADS, GROUP, DIM, BS, LAYERS = 3, 3, 16, 32, 4
PROMPT, BUDGET = 300, 64  # B' = 64 + (300 - 64) % 32 = 76, s = (300 - 76) / 32 - 1 = 6 blocks freed


def make_worker(method: str = "ada-snapkv") -> EvictionWorker:
    return EvictionWorker(build_policy(method, window=8), EvictionConfig(method, BUDGET), LAYERS, HEADS, BS)


def step_tensors(rows: list[list[int]], seq_lens: list[int], q_lens: list[int]):
    """(block_table [R, W] int32, vLLM slot mapping [T] int64) for block rows and per-request tokens."""
    width = max(len(r) for r in rows)
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = torch.tensor(row)
    slots = []
    for row, seq_len, q_len in zip(rows, seq_lens, q_lens, strict=True):
        positions = torch.arange(seq_len - q_len, seq_len)
        slots.append(torch.tensor(row)[positions // BS] * BS + positions % BS)
    return table, torch.cat(slots)


def run_step(worker, req_ids, prompt_lens, computed, q_lens, rows):
    seq_lens = [c + q for c, q in zip(computed, q_lens, strict=True)]
    worker.begin_step(StepInputs(list(req_ids), np.array(prompt_lens), np.array(computed), np.array(q_lens)))
    table, slots = step_tensors(rows, seq_lens, q_lens)
    return worker.make_step(len(req_ids), sum(q_lens), torch.tensor(seq_lens), table, slots)


def test_prefill_compacts_only_the_long_prompt_into_the_blocks_it_keeps() -> None:
    torch.manual_seed(0)
    worker = make_worker()
    long_row = list(range(10, 10 + cdiv(PROMPT, BS)))  # 10 blocks
    short_row = [40, 41]
    step = run_step(worker, ["long", "short"], [PROMPT, 50], [0, 0], [PROMPT, 50], [long_row, short_row])
    assert [r.req_id for r in step.compacting] == ["long"] and not step.has_compacted
    tokens = PROMPT + 50
    for layer in range(LAYERS):
        write = step.compact_layer(
            layer, torch.randn(tokens, HEADS * GROUP, DIM), torch.randn(tokens, HEADS, DIM),
            torch.randn(tokens, HEADS, DIM),
        )
        budget = worker.plan_for(PROMPT).layer_budgets[layer]
        assert write.slots.numel() == HEADS * budget
        assert write.slots.unique().numel() == write.slots.numel()
        # Only sub-blocks of the kept blocks [s, n) are written; rows come from the long request's tokens.
        kept_blocks = set(long_row[6:])
        assert {int(s) // BS // HEADS for s in write.slots} <= kept_blocks
        assert int(write.tokens.max()) < PROMPT
        # Every written row is written from its own head.
        subblock_heads = (write.slots // BS) % HEADS
        table = layer_table(worker, "long", layer)
        for head in range(HEADS):
            assert table.lengths[head] == int((write.heads == head).sum())
        assert subblock_heads.numel() == write.heads.numel()
    assert "long" in worker.requests and "short" not in worker.requests


def test_decode_reads_each_heads_own_sub_blocks_and_writes_after_its_kept_entries() -> None:
    torch.manual_seed(1)
    worker = make_worker()
    long_row = list(range(10, 20))
    run_prefill = run_step(worker, ["long"], [PROMPT], [0], [PROMPT], [long_row])
    for layer in range(LAYERS):
        run_prefill.compact_layer(
            layer, torch.randn(PROMPT, HEADS * GROUP, DIM), torch.randn(PROMPT, HEADS, DIM),
            torch.randn(PROMPT, HEADS, DIM),
        )
    worker.end_step()
    lengths_before = [list(layer_table(worker, "long", layer).lengths) for layer in range(LAYERS)]

    # Next step: the long request decodes (its freed blocks are now vLLM's null block 0); a new short
    # request prefills in the same batch.
    decode_row = [0] * 6 + long_row[6:]
    step = run_step(worker, ["long", "new"], [PROMPT, 20], [PROMPT, 0], [1, 20], [decode_row, [50]])
    assert step.has_compacted and not step.compacting
    for layer in range(LAYERS):
        batch = step.head_batch(layer)
        table = layer_table(worker, "long", layer)
        # Head-major sequences: head h of request r (0: "long", 1: "new") is sequence h * 2 + r.
        for head in range(HEADS):
            long_seq, new_seq = head * 2, head * 2 + 1
            assert int(batch.seq_lens[long_seq]) == lengths_before[layer][head] + 1 == table.lengths[head]
            used = cdiv(table.lengths[head], BS)
            assert batch.block_table[long_seq, :used].tolist() == table.subblocks[head][:used]
            # The new token sits right after the head's kept entries (slots stay token-major).
            assert int(batch.slot_mapping[head]) == int(table.head_slots(head)[-1])
            # The standard request: sub-block 50*H + h, full length.
            assert batch.block_table[new_seq, 0] == 50 * HEADS + head
            assert batch.seq_lens[new_seq] == 20
        new_slots = batch.slot_mapping[HEADS:].view(20, HEADS)  # vLLM's slot spread per head
        assert new_slots[5].tolist() == [(50 * HEADS + h) * BS + 5 for h in range(HEADS)]
        assert batch.query_start_loc.tolist() == [0, 1, 21, 22, 42, 43, 63]


def test_finished_and_restarted_requests_start_clean() -> None:
    worker = make_worker("snapkv")
    step = run_step(worker, ["a"], [PROMPT], [0], [PROMPT], [list(range(1, 11))])
    for layer in range(LAYERS):
        step.compact_layer(
            layer, torch.randn(PROMPT, HEADS * GROUP, DIM), torch.randn(PROMPT, HEADS, DIM),
            torch.randn(PROMPT, HEADS, DIM),
        )
    # SnapKV keeps the same count per head in every layer: one table serves all layers.
    assert worker.tables.store.num_groups == 1
    worker.end_step()
    # Preempted and recomputed from token 0: the old layout is dropped at once, the prompt compacts again.
    step = run_step(worker, ["a"], [PROMPT], [0], [PROMPT + 3], [list(range(21, 31))])
    assert "a" not in worker.requests and [r.req_id for r in step.compacting] == ["a"]
    worker.end_step()
    worker.drop({"a"})
    assert not worker.requests


def test_a_dummy_batch_that_does_not_match_the_step_gets_no_eviction_data() -> None:
    worker = make_worker()
    worker.begin_step(StepInputs(["a"], np.array([10]), np.array([0]), np.array([10])))
    table, slots = step_tensors([[1]], [4], [4])
    assert worker.make_step(1, 4, torch.tensor([4]), table, slots) is None
    worker.end_step()
    assert worker.make_step(1, 10, torch.tensor([10]), table, slots) is None


@pytest.mark.parametrize("method", [m.name for m in available_methods()])
def test_every_method_compacts_exactly_its_layer_budgets_through_the_worker(method: str) -> None:
    """The worker hands each policy the in-hand tensors it asks for (window queries, o_proj) and every
    registered method's selection lands in sub-blocks with the accounting's exact per-layer totals."""
    torch.manual_seed(2)
    worker = EvictionWorker(build_policy(method), EvictionConfig(method, 0.25), LAYERS, HEADS, BS)
    worker.o_proj = {layer: torch.randn(HEADS * GROUP * DIM, HEADS * GROUP * DIM) for layer in range(LAYERS)}
    prompt = 400
    step = run_step(worker, ["r"], [prompt], [0], [prompt], [list(range(1, 1 + cdiv(prompt, BS)))])
    plan = worker.plan_for(prompt)
    assert plan.compacts
    for layer in range(LAYERS):
        write = step.compact_layer(
            layer, torch.randn(prompt, HEADS * GROUP, DIM), torch.randn(prompt, HEADS, DIM),
            torch.randn(prompt, HEADS, DIM),
        )
        assert write.slots.numel() == HEADS * plan.layer_budgets[layer]
        assert write.slots.unique().numel() == write.slots.numel()
    assert "r" in worker.requests


class _BrokenPolicy:
    """Keeps one token too many in every layer (a policy bug)."""

    name = "broken"

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def select(self, layer, budget):
        return self.inner.select(layer, budget + 1)


def test_a_failing_policy_still_compacts_within_the_accounting_instead_of_crashing() -> None:
    config = EvictionConfig("snapkv", BUDGET)
    worker = EvictionWorker(build_policy("snapkv", window=8), config, LAYERS, HEADS, BS)
    worker.policy = _BrokenPolicy(worker.policy)
    step = run_step(worker, ["r"], [PROMPT], [0], [PROMPT], [list(range(1, 11))])
    budget = worker.plan_for(PROMPT).layer_budgets[0]
    write = step.compact_layer(
        0, torch.randn(PROMPT, HEADS * GROUP, DIM), torch.randn(PROMPT, HEADS, DIM),
        torch.randn(PROMPT, HEADS, DIM),
    )
    assert write.slots.numel() == HEADS * budget
    assert write.tokens.tolist() == list(range(PROMPT - budget, PROMPT)) * HEADS  # the most recent tokens
