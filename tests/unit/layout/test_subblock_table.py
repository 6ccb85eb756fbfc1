"""Per-head sub-block tables: assignment, growth and the free pool over the whole life of a request.

The request's blocks are simulated the way vLLM hands them out with the evicting manager: the prompt gets
ceil(P/bs) blocks, the scheduler frees blocks [0, s) after the prompt, and each later token gets a new
block exactly when ceil(position/bs) grows.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from compaction_reference import plan_compaction
from layout_cases import ragged_counts

from tests.unit.layout.subblock_reference import RequestSubBlocks, SubBlockPoolExhausted, SubBlockTable
from vllm_kvevict.layout.accounting import cdiv, plan_request
from vllm_kvevict.policies.registry import build_policy

NUM_LAYERS = 6


def check_table(table: SubBlockTable, blocks: list[int]) -> None:
    """Every head has exactly the sub-blocks its length needs; no sub-block is used twice; every sub-block
    of the request's blocks is either assigned or free (nothing lost, nothing foreign)."""
    heads, bs = table.num_kv_heads, table.block_size
    for h in range(heads):
        assert len(table.subblocks[h]) == cdiv(table.lengths[h], bs)
    owned = table.owned_subblocks()
    assert len(owned) == len(set(owned)), "a sub-block is assigned twice"
    assert sorted(owned) == sorted(b * heads + h for b in blocks for h in range(heads))
    slots = torch.cat([table.head_slots(h) for h in range(heads)])
    assert slots.unique().numel() == slots.numel(), "two tokens share a slot"


@pytest.mark.parametrize("seed", range(40))
def test_sub_blocks_never_run_out_and_never_double_assign(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([16, 32, 128])
    heads = rng.choice([1, 2, 3, 8])
    prompt_len = rng.randint(block_size + 1, 12 * block_size)
    budget = rng.choice([rng.randint(1, prompt_len), rng.uniform(0.05, 0.95)])
    method = rng.choice(["snapkv", "pyramidkv", "ada-snapkv"])
    plan = plan_request(prompt_len, budget, block_size, build_policy(method), NUM_LAYERS)
    if not plan.compacts:
        assert plan.blocks_to_free == 0
        return

    next_block = itertools.count(1)  # 0 is vLLM's null block
    row = [next(next_block) for _ in range(cdiv(prompt_len, block_size))]
    kept_row = row[plan.blocks_to_free :]
    request = RequestSubBlocks(NUM_LAYERS, heads, block_size, plan.blocks_to_free, kept_row)
    for layer, budget_l in enumerate(plan.layer_budgets):
        counts = ragged_counts(heads * budget_l, heads, prompt_len, rng)
        request.compact_layer(layer, counts)
    assert request.fully_compacted
    for table in request.tables:
        check_table(table, request.blocks)

    # Decode: position P + t is computed at step t; vLLM adds a block when the position needs one.
    for t in range(rng.randint(1, 3 * block_size)):
        seq_len = prompt_len + t + 1
        while len(row) < cdiv(seq_len, block_size):
            row.append(next(next_block))
        assert len(row) - plan.blocks_to_free == plan.blocks_held(t + 1)
        request.sync_blocks(row, cdiv(seq_len, block_size))
        slots = request.append(1)
        assert all(s.shape == (1, heads) for s in slots.values())
    for table in request.tables:
        check_table(table, request.blocks)
    # What the request owns when it finishes is exactly its blocks' sub-blocks: freeing the blocks frees all.
    assert request.blocks == row[plan.blocks_to_free :]


def test_layers_with_equal_counts_share_one_table() -> None:
    request = RequestSubBlocks(3, 2, 16, 1, [7, 8, 9])
    a = request.compact_layer(0, [10, 20])
    b = request.compact_layer(1, [20, 10])
    c = request.compact_layer(2, [10, 20])
    assert a is c and a is not b
    assert len(request.tables) == 2
    # Both tables draw from the same blocks: each layer has its own cache tensor.
    assert a.subblocks == [[14], [15, 16]] and b.subblocks == [[14, 15], [16]]


def test_assignment_is_deterministic_in_block_then_head_order() -> None:
    table = SubBlockTable.assign([33, 1, 0], blocks=[5, 2], num_kv_heads=3, block_size=32)
    assert table.subblocks == [[15, 16], [17], []]
    assert table.num_free == 3
    assert table.head_slots(0, 31, 33).tolist() == [15 * 32 + 31, 16 * 32]


def test_new_token_goes_to_the_end_of_each_heads_last_sub_block_or_a_free_one() -> None:
    table = SubBlockTable.assign([32, 5], blocks=[4, 6], num_kv_heads=2, block_size=32)
    slots = table.append(1)
    # Head 0 is full: takes the next free sub-block (4*2+1 = 9 went to head 1, so 6*2 = 12).
    assert slots.tolist() == [[12 * 32, 9 * 32 + 5]]
    assert table.lengths == [33, 6]


def test_running_out_of_sub_blocks_is_an_error_naming_the_rule() -> None:
    table = SubBlockTable.assign([32, 32], blocks=[3], num_kv_heads=2, block_size=32)
    with pytest.raises(SubBlockPoolExhausted, match="accounting rule"):
        table.append(1)


def test_compaction_plan_maps_kept_tokens_then_trailing_tokens_to_their_slots() -> None:
    table = SubBlockTable.assign([3, 1], blocks=[2, 3], num_kv_heads=2, block_size=4)
    table.append(2)  # two tokens computed after the prompt in the same step
    indices = torch.tensor([[0, 5, 9], [7, -1, -1]])
    counts = torch.tensor([3, 1])
    plan = plan_compaction(indices, counts, table, prompt_len=10, trailing_tokens=2)
    assert plan.src_heads.tolist() == [0] * 5 + [1] * 3
    assert plan.src_tokens.tolist() == [0, 5, 9, 10, 11, 7, 10, 11]
    # head 0: sub-block 4 (block 2, head 0), then 6 (block 3, head 0); head 1: sub-block 5.
    assert plan.dst_slots.tolist() == [16, 17, 18, 19, 24, 20, 21, 22]


def test_compaction_plan_rejects_indices_outside_the_prompt() -> None:
    table = SubBlockTable.assign([2], blocks=[1], num_kv_heads=1, block_size=4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        plan_compaction(torch.tensor([[1, 4]]), torch.tensor([2]), table, prompt_len=4)
