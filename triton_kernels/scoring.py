"""Observation-window scores read straight from the paged cache, one key tile at a time.

Pass 1 (grid: sequence x key range) runs an online softmax over its key range for every window query row
(group x w rows per sequence) and stores the partial row max and exp-sum. Pass 2 (grid: sequence x key
tile) merges those partials into each row's softmax denominator, recomputes its tile's logits, and writes
softmax averaged over the w window queries per query head. Nothing larger than a [rows, BLOCK_N] tile is
ever live, so memory is O(group * w) per sequence plus the [group, n] output. Pooling along the keys and
the GQA mean are cheap elementwise work left to torch. Callers validate inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _window_logits(
    q,
    keys,
    seq,
    seq_len,
    positions,
    row_valid,
    k_ptr,
    tables_ptr,
    stride_kb,
    stride_kt,
    stride_table,
    scale,
    dims,
    dim_valid,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """[rows, BLOCK_N] scaled logits of one key tile, -inf where causally hidden or out of range."""
    key_valid = keys < seq_len
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
    return tl.where(visible, logits, float("-inf"))


@triton.jit
def _load_window_queries(
    q_ptr,
    positions_ptr,
    seq,
    group,
    window,
    stride_qs,
    stride_qg,
    stride_qw,
    stride_ps,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    G_PAD: tl.constexpr,
    W_PAD: tl.constexpr,
):
    """Rows r = head * W_PAD + j of the window queries: ([rows, BLOCK_D], positions [rows], valid [rows])."""
    rows = tl.arange(0, G_PAD * W_PAD)
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
    return q, positions, row_valid, dims, dim_valid


@triton.jit
def _window_stats_kernel(
    q_ptr,  # [num_seqs, group, w, D]
    positions_ptr,  # [num_seqs, w] int32
    k_ptr,  # [S, bs, D]
    tables_ptr,  # [num_seqs, max_subblocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    max_ptr,  # [num_seqs, num_splits, rows] float32
    sum_ptr,  # [num_seqs, num_splits, rows] float32
    scale,
    group,
    window,
    split_len,
    num_splits,
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
):
    seq = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    q, positions, row_valid, dims, dim_valid = _load_window_queries(
        q_ptr,
        positions_ptr,
        seq,
        group,
        window,
        stride_qs,
        stride_qg,
        stride_qw,
        stride_ps,
        HEAD_SIZE,
        BLOCK_D,
        G_PAD,
        W_PAD,
    )
    m_i = tl.full([G_PAD * W_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD * W_PAD], tl.float32)
    kv_start = split * split_len
    kv_end = tl.minimum(seq_len, kv_start + split_len)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        logits = _window_logits(
            q,
            keys,
            seq,
            kv_end,
            positions,
            row_valid,
            k_ptr,
            tables_ptr,
            stride_kb,
            stride_kt,
            stride_table,
            scale,
            dims,
            dim_valid,
            BLOCK_SIZE,
            DOT_PRECISION,
        )
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(logits - m_safe[:, None]), 1)
        m_i = m_new
    rows = tl.arange(0, G_PAD * W_PAD)
    out = (seq.to(tl.int64) * num_splits + split) * (G_PAD * W_PAD) + rows
    tl.store(max_ptr + out, m_i)
    tl.store(sum_ptr + out, l_i)


@triton.jit
def _window_scores_kernel(
    q_ptr,
    positions_ptr,
    k_ptr,
    tables_ptr,
    seq_lens_ptr,
    max_ptr,
    sum_ptr,
    scores_ptr,  # [num_seqs, group, max_len] float32
    scale,
    group,
    window,
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
):
    seq = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    seq_len = tl.load(seq_lens_ptr + seq)
    if n0 >= seq_len:
        return
    rows = tl.arange(0, G_PAD * W_PAD)
    stats = seq.to(tl.int64) * num_splits * (G_PAD * W_PAD) + rows
    m = tl.full([G_PAD * W_PAD], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(max_ptr + stats + s * (G_PAD * W_PAD)))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([G_PAD * W_PAD], tl.float32)
    for s in range(num_splits):
        part = stats + s * (G_PAD * W_PAD)
        denom += tl.load(sum_ptr + part) * tl.exp(tl.load(max_ptr + part) - m_safe)
    q, positions, row_valid, dims, dim_valid = _load_window_queries(
        q_ptr,
        positions_ptr,
        seq,
        group,
        window,
        stride_qs,
        stride_qg,
        stride_qw,
        stride_ps,
        HEAD_SIZE,
        BLOCK_D,
        G_PAD,
        W_PAD,
    )
    keys = n0 + tl.arange(0, BLOCK_N)
    logits = _window_logits(
        q,
        keys,
        seq,
        seq_len,
        positions,
        row_valid,
        k_ptr,
        tables_ptr,
        stride_kb,
        stride_kt,
        stride_table,
        scale,
        dims,
        dim_valid,
        BLOCK_SIZE,
        DOT_PRECISION,
    )
    # a query that sees no key has denom 0: it adds nothing (its exp terms are all 0 too)
    probs = tl.exp(logits - m_safe[:, None]) / tl.where(denom > 0.0, denom, 1.0)[:, None]
    per_head = tl.sum(tl.reshape(probs, (G_PAD, W_PAD, BLOCK_N)), 1) / window
    heads = tl.arange(0, G_PAD)
    out = (seq.to(tl.int64) * group + heads)[:, None] * max_len + keys[None, :]
    tl.store(scores_ptr + out, per_head, mask=(heads < group)[:, None] & (keys < seq_len)[None, :])


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
    _window_stats_kernel[(num_seqs, num_splits)](
        queries,
        query_positions,
        k_cache,
        subblock_tables,
        seq_lens,
        row_max,
        row_sum,
        scale,
        group,
        window,
        split_len,
        num_splits,
        *strides,
        **common,
    )
    _window_scores_kernel[(num_seqs, triton.cdiv(max_len, block_n))](
        queries,
        query_positions,
        k_cache,
        subblock_tables,
        seq_lens,
        row_max,
        row_sum,
        scores,
        scale,
        group,
        window,
        num_splits,
        max_len,
        *strides,
        **common,
    )
    return scores


def pool_ragged(
    scores: torch.Tensor, seq_lens: torch.Tensor, num_pooled: torch.Tensor | None, kernel: int, kind: str
) -> torch.Tensor:
    """Pool [num_seqs, group, n] scores along n over each sequence's first num_pooled keys (stride 1, same
    length, kvpress's padding: -inf for max, zeros counted for avg); later keys keep their score, keys past
    seq_len are 0."""
    if kernel == 1 or scores.shape[-1] == 0:
        return scores
    num_seqs, group, n = scores.shape
    positions = torch.arange(n, device=scores.device)
    pooled_len = seq_lens if num_pooled is None else num_pooled
    in_pool = positions[None, None, :] < pooled_len.to(scores.device)[:, None, None]
    fill = float("-inf") if kind == "max" else 0.0
    flat = scores.masked_fill(~in_pool, fill).reshape(num_seqs * group, 1, n)
    pool = F.max_pool1d if kind == "max" else F.avg_pool1d
    pooled = pool(flat, kernel_size=kernel, stride=1, padding=kernel // 2).reshape(num_seqs, group, n)
    return torch.where(in_pool, pooled, scores)


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
    return pool_ragged(per_query_head, seq_lens, num_pooled, pool_kernel, pool_kind).mean(dim=1)
