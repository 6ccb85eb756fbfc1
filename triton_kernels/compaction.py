"""Compaction: move kept token rows between slots of many layer caches in two launches per step.

Launch 1 gathers every kept row (all requests, layers and planes of the step) into a temporary buffer,
launch 2 scatters the buffer into the destination slots. Two launches because sources and destinations
overlap: no row may be written before every row has been read, and a grid has no global barrier.

Layer caches are addressed through a table of base pointers so that separately allocated layer tensors
(vLLM allocates one per layer) need neither stacking nor a launch per layer. Callers validate inputs
(``vllm_kvevict.layout.kernels.views.check_moves``); this module trusts them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MOVES_PER_PROGRAM = 16


@triton.jit
def _move_rows_kernel(
    cache_ptrs,  # [L] int64 base addresses of the layer caches
    slots_ptr,  # [M] int64 slot of each move inside its layer (source when gathering, destination scattering)
    layer_ptr,  # [M] int64 layer of each move
    buffer_ptr,  # [M, P, D] staging buffer
    num_moves,
    num_planes,
    plane_stride,
    subblock_stride,
    token_stride,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GATHER: tl.constexpr,
):
    moves = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = moves < num_moves
    slots = tl.load(slots_ptr + moves, mask=valid, other=0)
    layers = tl.load(layer_ptr + moves, mask=valid, other=0)
    bases = tl.load(cache_ptrs + layers, mask=valid, other=0).to(tl.pointer_type(buffer_ptr.dtype.element_ty))
    row_offsets = (slots // BLOCK_SIZE) * subblock_stride + (slots % BLOCK_SIZE) * token_stride
    dims = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (dims[None, :] < HEAD_SIZE)
    for plane in range(num_planes):
        cache_rows = bases[:, None] + (row_offsets + plane * plane_stride)[:, None] + dims[None, :]
        buffer_rows = (
            buffer_ptr + (moves.to(tl.int64) * num_planes + plane)[:, None] * HEAD_SIZE + dims[None, :]
        )
        if GATHER:
            tl.store(buffer_rows, tl.load(cache_rows, mask=mask), mask=mask)
        else:
            tl.store(cache_rows, tl.load(buffer_rows, mask=mask), mask=mask)


def compact_slots(
    caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor, layer_idx: torch.Tensor
) -> None:
    """In-place compaction of validated moves (reference: ``reference.compact_subblocks`` in the layout).

    caches: L layer caches, each [S, bs, D] or [P, S, bs, D], identical shapes and strides.
    src_slots, dst_slots, layer_idx: [M] int64.
    """
    num_moves = src_slots.numel()
    if num_moves == 0:
        return
    first = caches[0]
    planes = first.unsqueeze(0) if first.dim() == 3 else first
    num_planes, _, block_size, head_size = planes.shape
    device = first.device
    cache_ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=device)
    buffer = torch.empty(num_moves, num_planes, head_size, dtype=first.dtype, device=device)
    grid = (triton.cdiv(num_moves, MOVES_PER_PROGRAM),)
    layer_idx = layer_idx.to(torch.int64)
    for slots, gather in ((src_slots, True), (dst_slots, False)):
        _move_rows_kernel[grid](
            cache_ptrs,
            slots.to(torch.int64),
            layer_idx,
            buffer,
            num_moves,
            num_planes,
            planes.stride(0),
            planes.stride(1),
            planes.stride(2),
            BLOCK_SIZE=block_size,
            HEAD_SIZE=head_size,
            BLOCK_D=triton.next_power_of_2(head_size),
            BLOCK_M=MOVES_PER_PROGRAM,
            GATHER=gather,
        )
