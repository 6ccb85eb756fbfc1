"""Observation-window scores read straight from the paged cache, one key tile at a time.

Pass 1 (grid: sequence x key range) runs an online softmax over its key range for every window query row
(group x w rows per sequence) and stores the partial row max and exp-sum. Pass 2 (grid: sequence x key
tile) merges those partials into each row's softmax denominator, recomputes its tile's logits, and writes
softmax averaged over the w window queries per query head. Both passes are one kernel (``SCORES`` picks
the pass), so the query load and the tile's logits are written once. Nothing larger than a [rows, BLOCK_N]
tile is ever live, so memory is O(group * w) per sequence plus the [group, n] output. A third tiny kernel
pools along the keys and averages over the GQA group. Callers validate inputs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _window_pass_kernel(
    q_ptr,  # [num_seqs, group, w, D]
    positions_ptr,  # [num_seqs, w] int32
    k_ptr,  # [S, bs, D]
    tables_ptr,  # [num_seqs, max_subblocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    max_ptr,  # [num_seqs, num_splits, rows] float32: pass 1 writes it, pass 2 reads it
    sum_ptr,  # [num_seqs, num_splits, rows] float32: likewise
    scores_ptr,  # [num_seqs, group, max_len] float32: pass 2 writes it
    scale,
    group,
    window,
    split_len,  # keys per program: a key range in pass 1, BLOCK_N (one tile) in pass 2
    num_splits,
    max_len,
    stride_qs,
    stride_qg,
    stride_qw,
    stride_ps,
    stride_kb,
    stride_kt,
    stride_table,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    G_PAD: tl.constexpr,
    W_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCORES: tl.constexpr,  # False: pass 1 (a key range's row max and exp-sum); True: pass 2 (a tile's scores)
):
    seq = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start = tl.program_id(1) * split_len
    kv_end = tl.minimum(seq_len, kv_start + split_len)
    rows = tl.arange(0, G_PAD * W_PAD)
    stats = seq.to(tl.int64) * num_splits * (G_PAD * W_PAD) + rows
    if SCORES:
        if kv_start >= seq_len:  # a tile past this sequence's end: nothing to write
            return
        # merge every split's partials into each row's max and softmax denominator
        m = tl.full([G_PAD * W_PAD], float("-inf"), tl.float32)
        for s in range(num_splits):
            m = tl.maximum(m, tl.load(max_ptr + stats + s * (G_PAD * W_PAD)))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        denom = tl.zeros([G_PAD * W_PAD], tl.float32)
        for s in range(num_splits):
            part = stats + s * (G_PAD * W_PAD)
            denom += tl.load(sum_ptr + part) * tl.exp(tl.load(max_ptr + part) - m_safe)
    # the window queries, row r = head * W_PAD + j: [rows, BLOCK_D], their positions [rows]
    head = rows // W_PAD
    j = rows % W_PAD
    row_valid = (head < group) & (j < window)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_SIZE
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qs + (head * stride_qg + j * stride_qw)[:, None] + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    positions = tl.load(positions_ptr + seq * stride_ps + j, mask=row_valid, other=-1)
    m_i = tl.full([G_PAD * W_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD * W_PAD], tl.float32)
    # pass 2's one tile is a constant trip count: the compiler drops the loop (no pipelining buffers)
    num_tiles = 1 if SCORES else tl.cdiv(kv_end - kv_start, BLOCK_N)
    for tile in range(0, num_tiles):
        keys = kv_start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        # [rows, BLOCK_N] scaled logits of the tile, -inf where causally hidden or out of range
        key_valid = keys < kv_end
        subblocks = tl.load(tables_ptr + seq * stride_table + keys // BLOCK_SIZE, mask=key_valid, other=0)
        k = tl.load(
            k_ptr
            + subblocks.to(tl.int64)[:, None] * stride_kb
            + ((keys % BLOCK_SIZE) * stride_kt)[:, None]
            + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = key_valid[None, :] & (keys[None, :] <= positions[:, None]) & row_valid[:, None]
        logits = tl.where(visible, logits, float("-inf"))
        if SCORES:
            # a query that sees no key has denom 0: it adds nothing (its exp terms are all 0 too)
            probs = tl.exp(logits - m_safe[:, None]) / tl.where(denom > 0.0, denom, 1.0)[:, None]
            per_head = tl.sum(tl.reshape(probs, (G_PAD, W_PAD, BLOCK_N)), 1) / window
            heads = tl.arange(0, G_PAD)
            out = (seq.to(tl.int64) * group + heads)[:, None] * max_len + keys[None, :]
            tl.store(scores_ptr + out, per_head, mask=(heads < group)[:, None] & (keys < kv_end)[None, :])
        else:
            m_new = tl.maximum(m_i, tl.max(logits, 1))
            m_safe_i = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe_i) + tl.sum(tl.exp(logits - m_safe_i[:, None]), 1)
            m_i = m_new
    if not SCORES:
        split = stats + tl.program_id(1) * (G_PAD * W_PAD)
        tl.store(max_ptr + split, m_i)
        tl.store(sum_ptr + split, l_i)


def window_attention_paged(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    subblock_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """[num_seqs, group, max_len] float32 softmax(q k^T / sqrt(D)) averaged over the w window queries.

    queries [num_seqs, group, w, D]; query_positions [num_seqs, w] (None = the last w of each sequence);
    0 past each seq_len.
    """
    num_seqs, group, window, head_size = queries.shape
    max_len = int(seq_lens.max()) if max_seq_len is None and num_seqs else (max_seq_len or 0)
    scores = torch.zeros(num_seqs, group, max_len, dtype=torch.float32, device=queries.device)
    if num_seqs == 0 or max_len == 0:
        return scores
    queries = queries if queries.stride(-1) == 1 else queries.contiguous()
    if query_positions is None:
        query_positions = (
            seq_lens[:, None].to(torch.int32)
            - window
            + torch.arange(window, device=queries.device, dtype=torch.int32)
        )
    query_positions = query_positions.to(torch.int32).contiguous()
    g_pad = triton.next_power_of_2(group)
    w_pad = max(triton.next_power_of_2(window), triton.cdiv(16, g_pad))  # tl.dot wants >= 16 rows
    if num_splits is None:
        num_splits = 1 if queries.device.type != "cuda" else max(1, min(64, triton.cdiv(max_len, 4096)))
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    rows = g_pad * w_pad
    row_max = torch.empty(num_seqs, num_splits, rows, dtype=torch.float32, device=queries.device)
    row_sum = torch.empty_like(row_max)
    common = dict(
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_SIZE=head_size,
        BLOCK_D=triton.next_power_of_2(head_size),
        G_PAD=g_pad,
        W_PAD=w_pad,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if queries.dtype == torch.float32 else "tf32",
    )
    strides = (
        queries.stride(0),
        queries.stride(1),
        queries.stride(2),
        query_positions.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        subblock_tables.stride(0),
    )
    scale = 1.0 / math.sqrt(head_size)
    args = (queries, query_positions, k_cache, subblock_tables, seq_lens, row_max, row_sum, scores, scale)
    _window_pass_kernel[(num_seqs, num_splits)](
        *args, group, window, split_len, num_splits, max_len, *strides, **common, SCORES=False
    )
    _window_pass_kernel[(num_seqs, triton.cdiv(max_len, block_n))](
        *args, group, window, block_n, num_splits, max_len, *strides, **common, SCORES=True
    )
    return scores


@triton.jit
def _pool_group_mean_kernel(
    scores_ptr,  # [num_seqs, group, max_len] float32 window means per query head
    seq_lens_ptr,  # [num_seqs] int32
    pooled_lens_ptr,  # [num_seqs] int32: pool over keys [0, pooled_len) only
    out_ptr,  # [num_seqs, max_len] float32
    group,
    max_len,
    KERNEL: tl.constexpr,
    IS_MAX: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Same-length pooling along the keys (kvpress padding: -inf for max, zeros counted for avg), then the
    mean over the GQA group; keys from pooled_len on keep their raw score, keys past seq_len are 0."""
    seq = tl.program_id(0)
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seq_len = tl.load(seq_lens_ptr + seq)
    pooled_len = tl.load(pooled_lens_ptr + seq)
    valid = keys < seq_len
    pad = float("-inf") if IS_MAX else 0.0
    total = tl.zeros([BLOCK_N], tl.float32)
    for head in range(group):
        row = scores_ptr + (seq.to(tl.int64) * group + head) * max_len
        raw = tl.load(row + keys, mask=valid, other=0.0)
        pooled = tl.full([BLOCK_N], pad, tl.float32)
        for shift in tl.static_range(KERNEL):
            neighbour = keys + (shift - KERNEL // 2)
            inside = (neighbour >= 0) & (neighbour < pooled_len)
            value = tl.load(row + neighbour, mask=inside, other=pad)
            pooled = tl.maximum(pooled, value) if IS_MAX else pooled + value
        if not IS_MAX:
            pooled = pooled / KERNEL
        total += tl.where(keys < pooled_len, pooled, raw)
    tl.store(out_ptr + seq.to(tl.int64) * max_len + keys, total / group, mask=keys < max_len)


def paged_window_scores(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    subblock_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    num_pooled: torch.Tensor | None = None,
    pool_kernel: int = 7,
    pool_kind: str = "max",
    num_splits: int | None = None,
) -> torch.Tensor:
    """[num_seqs, max_len] scores; see ``vllm_kvevict.layout.kernels.reference.paged_window_scores``."""
    per_query_head = window_attention_paged(
        queries, k_cache, subblock_tables, seq_lens, query_positions, num_splits=num_splits
    )
    num_seqs, group, max_len = per_query_head.shape
    scores = torch.zeros(num_seqs, max_len, dtype=torch.float32, device=queries.device)
    if num_seqs == 0 or max_len == 0:
        return scores
    pooled_lens = (seq_lens if num_pooled is None else num_pooled).to(torch.int32).contiguous()
    block_n = 128
    _pool_group_mean_kernel[(num_seqs, triton.cdiv(max_len, block_n))](
        per_query_head,
        seq_lens,
        pooled_lens,
        scores,
        group,
        max_len,
        KERNEL=pool_kernel,
        IS_MAX=pool_kind == "max",
        BLOCK_N=block_n,
    )
    return scores
