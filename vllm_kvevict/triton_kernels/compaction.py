"""Compaction: move kept token rows between slots of many layer caches in two launches per step.

Launch 1 gathers every kept row (all requests, layers and planes of the step) into a temporary buffer,
launch 2 scatters the buffer into the destination slots. Two launches because sources and destinations
overlap: no row may be written before every row has been read, and a grid has no global barrier.

Layer caches are addressed by element offsets from the first one, so that separately allocated layer tensors
(vLLM allocates one per layer) need neither stacking nor a launch per layer, and Triton still sees one
aligned base pointer and can vectorise. Callers validate inputs
(``vllm_kvevict.layout.kernels.views.check_moves``); this module trusts them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MOVES_PER_PROGRAM = 16
MAX_VECTOR_BYTES = 16


@triton.jit
def _move_rows_kernel(
    cache_ptr,  # layer cache 0; the others are reached by element offsets from it
    layer_offsets_ptr,  # [L] int64 element offset of each layer cache from layer cache 0
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
    VECTOR: tl.constexpr,  # elements every row start is a multiple of: lets Triton emit 16-byte accesses
    GATHER: tl.constexpr,
):
    moves = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = moves < num_moves
    slots = tl.load(slots_ptr + moves, mask=valid, other=0)
    layers = tl.load(layer_ptr + moves, mask=valid, other=0)
    layer_offsets = tl.load(layer_offsets_ptr + layers, mask=valid, other=0)
    rows = layer_offsets + (slots // BLOCK_SIZE) * subblock_stride + (slots % BLOCK_SIZE) * token_stride
    dims = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (dims[None, :] < HEAD_SIZE)
    for plane in range(num_planes):
        cache_rows = cache_ptr + tl.multiple_of(rows + plane * plane_stride, VECTOR)[:, None] + dims[None, :]
        buffer_rows = (
            buffer_ptr + (moves.to(tl.int64) * num_planes + plane)[:, None] * HEAD_SIZE + dims[None, :]
        )
        if GATHER:
            tl.store(buffer_rows, tl.load(cache_rows, mask=mask), mask=mask)
        else:
            tl.store(cache_rows, tl.load(buffer_rows, mask=mask), mask=mask)


def row_vector(caches: list[torch.Tensor], strides: tuple[int, ...], head_size: int) -> int:
    """Largest element count (a power of two, at most 16 bytes) dividing every row start of every layer."""
    element = caches[0].element_size()
    byte_values = [s * element for s in strides] + [head_size * element] + [c.data_ptr() for c in caches]
    vector_bytes = MAX_VECTOR_BYTES
    while vector_bytes > element and any(v % vector_bytes for v in byte_values):
        vector_bytes //= 2
    return max(1, vector_bytes // element)


def compact_slots(
    caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor, layer_idx: torch.Tensor
) -> None:
    """In-place compaction of validated moves (reference: ``reference.compact_subblocks`` in the layout).

    caches: L layer caches, each [S, bs, D] or [P, S, bs, D], identical shapes, strides and dtype.
    src_slots, dst_slots, layer_idx: [M] int64.
    """
    num_moves = src_slots.numel()
    if num_moves == 0:
        return
    first = caches[0]
    planes = first.unsqueeze(0) if first.dim() == 3 else first
    num_planes, _, block_size, head_size = planes.shape
    device = first.device
    element = first.element_size()
    # same-dtype allocations are element-aligned to each other, so byte distances divide exactly
    layer_offsets = torch.tensor(
        [(c.data_ptr() - first.data_ptr()) // element for c in caches], dtype=torch.int64, device=device
    )
    strides = (planes.stride(0), planes.stride(1), planes.stride(2))
    buffer = torch.empty(num_moves, num_planes, head_size, dtype=first.dtype, device=device)
    grid = (triton.cdiv(num_moves, MOVES_PER_PROGRAM),)
    layer_idx = layer_idx.to(torch.int64)
    for slots, gather in ((src_slots, True), (dst_slots, False)):
        _move_rows_kernel[grid](
            first,
            layer_offsets,
            slots.to(torch.int64),
            layer_idx,
            buffer,
            num_moves,
            num_planes,
            *strides,
            BLOCK_SIZE=block_size,
            HEAD_SIZE=head_size,
            BLOCK_D=triton.next_power_of_2(head_size),
            BLOCK_M=MOVES_PER_PROGRAM,
            VECTOR=row_vector(caches, strides, head_size),
            GATHER=gather,
        )
