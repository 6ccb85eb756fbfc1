"""Builders of small paged caches for the kernel tests: known dense sequences scattered into sub-blocks.

Importable without vLLM so the same cases run on a GPU machine that has only torch and triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 16


@dataclass
class PagedSequences:
    """Dense per-sequence keys/values and the same data laid out in a paged sub-block cache.

    keys[i], values[i]: [seq_lens[i], D]; k_cache, v_cache: [S, bs, D]; subblock_tables: [num_seqs, max_sb]
    int32, padded with -1 past each sequence's sub-blocks (never to be read).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    subblock_tables: torch.Tensor
    seq_lens: torch.Tensor


def paged_sequences(
    seq_lens: list[int],
    head_size: int = 64,
    block_size: int = BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_subblocks: int = 3,
    seed: int = 0,
) -> PagedSequences:
    """Sequences of the given lengths in sub-blocks handed out in a random order (tables out of order)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_subblocks = sum(needed) + spare_subblocks
    order = torch.randperm(num_subblocks, generator=gen)
    k_cache = torch.randn(num_subblocks, block_size, head_size, generator=gen).to(dtype)
    v_cache = torch.randn(num_subblocks, block_size, head_size, generator=gen).to(dtype)
    tables = torch.full((len(seq_lens), max(needed, default=0) + 1), -1, dtype=torch.int32)
    keys, values, next_free = [], [], 0
    for i, (n, count) in enumerate(zip(seq_lens, needed, strict=True)):
        ids = order[next_free : next_free + count]
        next_free += count
        tables[i, :count] = ids.to(torch.int32)
        tokens = torch.arange(n)
        subblocks, offsets = ids[tokens // block_size], tokens % block_size
        keys.append(k_cache[subblocks, offsets].to(device))
        values.append(v_cache[subblocks, offsets].to(device))
    return PagedSequences(
        keys=keys,
        values=values,
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        subblock_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def query_start_loc(query_lens: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """[num_seqs + 1] int32 offsets of each sequence's query rows."""
    return torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def compaction_plan(
    num_layers: int, num_subblocks: int, block_size: int, kept_fraction: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Moves as eviction makes them: per layer, kept rows of a run of sub-blocks slide densely to the front
    of that run, so most destinations are also sources of other moves (overlap).

    Returns src_slots, dst_slots, layer_idx: [M] int64.
    """
    gen = torch.Generator().manual_seed(seed)
    src, dst, layer = [], [], []
    for layer_id in range(num_layers):
        run = torch.randperm(num_subblocks, generator=gen)[: max(2, num_subblocks // 2)]
        slots = (run[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)
        kept = slots[torch.rand(slots.numel(), generator=gen) < kept_fraction]
        src.append(kept)
        dst.append(slots[: kept.numel()])
        layer.append(torch.full_like(kept, layer_id))
    return torch.cat(src), torch.cat(dst), torch.cat(layer)
