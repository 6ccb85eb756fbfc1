"""Plain-torch reference ops on the paged views of ``views.py``: slow, obvious, and the ground truth.

Every faster implementation (Triton in ``vllm_kvevict/triton_kernels/``, CUDA in ``csrc/``) is tested
against these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vllm_kvevict.layout.kernels.views import (
    as_layer_list,
    check_layer_caches,
    check_moves,
    check_sequences,
    sequence_slots,
)

POOL_KINDS = ("max", "avg")


def compact_subblocks(
    caches: torch.Tensor | Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layer_idx: torch.Tensor | None = None,
) -> None:
    """Move kept token rows to their new slots, in place, for many requests and layers at once.

    caches: one layer cache or a list of L, each ``[S, bs, D]`` or ``[P, S, bs, D]`` (all planes move);
        layers stacked in one tensor ``[L, ...]`` go in as ``stacked.unbind(0)`` (views, nothing copied).
    src_slots, dst_slots: [M] slots (``subblock * bs + offset``) of move m, in layer ``layer_idx[m]``.
    layer_idx: [M] index into ``caches``; may be None with a single layer.
    Sources and destinations may overlap (compaction slides entries towards the front), so every source
    is read into a temporary buffer before any destination is written.
    """
    caches = as_layer_list(caches)
    check_layer_caches(caches)
    layer_idx = check_moves(caches, src_slots, dst_slots, layer_idx)
    block_size = caches[0].shape[-2]
    src, dst = src_slots.to(torch.int64), dst_slots.to(torch.int64)
    staged = []
    for layer in torch.unique(layer_idx).tolist():
        sel = layer_idx == layer
        rows = src[sel]
        staged.append((layer, dst[sel], caches[layer][..., rows // block_size, rows % block_size, :].clone()))
    for layer, rows, values in staged:
        caches[layer][..., rows // block_size, rows % block_size, :] = values


def gather_sequence(
    cache: torch.Tensor, subblock_tables: torch.Tensor, seq_lens: torch.Tensor, seq: int
) -> torch.Tensor:
    """[seq_lens[seq], D] token rows of sequence ``seq`` from a ``[S, bs, D]`` cache, in token order."""
    block_size = cache.shape[1]
    slots = sequence_slots(subblock_tables, int(seq_lens[seq]), seq, block_size)
    return cache[slots // block_size, slots % block_size]


def ragged_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    subblock_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of each (request, KV head) sequence over its own paged, possibly compacted, keys and values.

    query: [T, group, D] query rows; sequence i owns rows ``query_start_loc[i] : query_start_loc[i + 1]``
        ([num_seqs + 1] int32, None = one row per sequence, i.e. decode), each row holding the ``group``
        query heads that share the sequence's KV head.
    k_cache, v_cache: [S, bs, D] sub-block views; subblock_tables [num_seqs, max_subblocks] int32 and
        seq_lens [num_seqs] int32 as in ``views.py``. seq_lens include the query tokens already written.
    causal: query row j of a sequence with q_len rows sees keys ``0 .. seq_len - q_len + j`` (its new tokens
        are the last q_len of the sequence: decode and prefill chunks); False: every row sees all keys.
    Returns [T, group, D] in query's dtype; a row that sees no key is 0. Math is float32.
    """
    check_sequences(k_cache, subblock_tables, seq_lens, v_cache)
    num_seqs = subblock_tables.shape[0]
    query_start_loc = check_query_layout(query, num_seqs, query_start_loc, k_cache.shape[2])
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    out = torch.zeros_like(query)
    for seq in range(num_seqs):
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        seq_len = int(seq_lens[seq])
        if end == start or seq_len == 0:
            continue
        keys = gather_sequence(k_cache, subblock_tables, seq_lens, seq).float()
        values = gather_sequence(v_cache, subblock_tables, seq_lens, seq).float()
        q = query[start:end].float().transpose(0, 1)  # [group, q_len, D]
        logits = q @ keys.T * scale  # [group, q_len, seq_len]
        if causal:
            last_visible = seq_len - (end - start) + torch.arange(end - start, device=query.device)
            hidden = torch.arange(seq_len, device=query.device)[None, :] > last_visible[:, None]
            logits = logits.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # all-masked rows give NaN -> 0
        out[start:end] = (probs @ values).transpose(0, 1).to(query.dtype)
    return out


def check_query_layout(
    query: torch.Tensor, num_seqs: int, query_start_loc: torch.Tensor | None, head_size: int
) -> torch.Tensor:
    """Validate [T, group, D] queries against [num_seqs + 1] start offsets; returns the offsets."""
    if query.dim() != 3 or query.shape[-1] != head_size:
        raise ValueError(f"query must be [T, group, D={head_size}], got shape {tuple(query.shape)}")
    if query_start_loc is None:
        if query.shape[0] != num_seqs:
            raise ValueError(
                f"without query_start_loc every sequence has one query row: query has {query.shape[0]} rows, "
                f"there are {num_seqs} sequences"
            )
        return torch.arange(num_seqs + 1, device=query.device, dtype=torch.int32)
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}] int32, got shape "
            f"{tuple(query_start_loc.shape)} dtype {query_start_loc.dtype}"
        )
    steps = query_start_loc[1:] - query_start_loc[:-1]
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != query.shape[0] or bool((steps < 0).any()):
        raise ValueError(
            f"query_start_loc must rise from 0 to T={query.shape[0]}, got {query_start_loc.tolist()[:8]}..."
        )
    return query_start_loc


def paged_window_scores(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    subblock_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    num_pooled: torch.Tensor | None = None,
    pool_kernel: int = 7,
    pool_kind: str = "max",
) -> torch.Tensor:
    """Observation-window scores of each (request, KV head) sequence, keys read from the paged cache.

    queries: [num_seqs, group, w, D] window queries of the ``group`` query heads of each sequence's KV head.
    query_positions: [num_seqs, w] positions of those queries (causal mask); None = the last w positions.
    num_pooled: [num_seqs] pool over the first num_pooled[i] keys only (kvpress pools the keys before the
        window); the keys after them keep their unpooled score. None = pool all seq_len keys.
    pool_kernel: odd pooling width; 1 = no pooling. pool_kind: "max" or "avg".
    Returns [num_seqs, max(seq_lens)] float32: per key, softmax(q k^T / sqrt(D)) averaged over the w window
    queries, pooled along the keys, averaged over the group; 0 past seq_len. This is exactly the policy
    library's ``group_mean(pool_scores(window_attention(...)))`` applied to the gathered keys.
    """
    from vllm_kvevict.policies.attention_scores import group_mean, pool_scores, window_attention

    check_sequences(k_cache, subblock_tables, seq_lens)
    num_seqs = subblock_tables.shape[0]
    check_window(queries, seq_lens, k_cache.shape[2], query_positions, num_pooled, pool_kernel, pool_kind)
    max_len = int(seq_lens.max()) if num_seqs else 0
    out = torch.zeros(num_seqs, max_len, dtype=torch.float32, device=queries.device)
    for seq in range(num_seqs):
        seq_len = int(seq_lens[seq])
        if seq_len == 0:
            continue
        keys = gather_sequence(k_cache, subblock_tables, seq_lens, seq)[None]  # [1, n, D]
        positions = None if query_positions is None else query_positions[seq]
        per_query_head = window_attention(queries[seq], keys, positions)  # [group, n]
        pooled_len = seq_len if num_pooled is None else int(num_pooled[seq])
        if pool_kernel > 1 and pooled_len > 0:
            per_query_head = torch.cat(
                [
                    pool_scores(per_query_head[:, :pooled_len], kernel=pool_kernel, kind=pool_kind),
                    per_query_head[:, pooled_len:],
                ],
                dim=-1,
            )
        out[seq, :seq_len] = group_mean(per_query_head, 1)[0]
    return out


def check_window(
    queries: torch.Tensor,
    seq_lens: torch.Tensor,
    head_size: int,
    query_positions: torch.Tensor | None,
    num_pooled: torch.Tensor | None,
    pool_kernel: int,
    pool_kind: str,
) -> None:
    """Validate the arguments of ``paged_window_scores`` beyond the cache and tables."""
    num_seqs = seq_lens.shape[0]
    if queries.dim() != 4 or queries.shape[0] != num_seqs or queries.shape[-1] != head_size:
        raise ValueError(
            f"queries must be [num_seqs={num_seqs}, group, w, D={head_size}], got {tuple(queries.shape)}"
        )
    window = queries.shape[2]
    if query_positions is not None and query_positions.shape != (num_seqs, window):
        raise ValueError(
            f"query_positions must be [num_seqs={num_seqs}, w={window}], got {tuple(query_positions.shape)}"
        )
    if num_pooled is not None and num_pooled.shape != (num_seqs,):
        raise ValueError(f"num_pooled must be [num_seqs={num_seqs}], got {tuple(num_pooled.shape)}")
    if num_pooled is not None and bool(((num_pooled < 0) | (num_pooled > seq_lens)).any()):
        raise ValueError(f"num_pooled must lie in [0, seq_len] per sequence, got {num_pooled.tolist()[:8]}")
    if pool_kind not in POOL_KINDS:
        raise ValueError(f"pool_kind {pool_kind!r} is not one of {POOL_KINDS}")
    if pool_kernel < 1 or pool_kernel % 2 == 0:
        raise ValueError(f"pool_kernel must be a positive odd width, got {pool_kernel}")
