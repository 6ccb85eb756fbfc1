"""Ragged paged attention: one (request, KV head) sequence per program row-block, per-head lengths.

Each sequence has ``group`` query heads, its own sub-block table and its own length, so Ada-KV's ragged
per-head budgets need no padding. A program holds BLOCK_Q query tokens x the group's heads as the rows of
one tile, walks the sequence's keys in BLOCK_N tiles gathered through the sub-block table (online softmax),
and, for long sequences with few programs, works on one of ``num_splits`` key ranges whose partial results a
second small kernel merges by log-sum-exp (flash-decoding). Decode is BLOCK_Q = 1 token; prefill chunks
reading a compacted cache use the causal rule "query j of q_len sees keys up to seq_len - q_len + j".
Callers validate inputs (``vllm_kvevict.layout.kernels.views``); this module trusts them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _ragged_attention_kernel(
    q_ptr,  # [T, group, D]
    k_ptr,  # [S, bs, D]
    v_ptr,  # [S, bs, D]
    tables_ptr,  # [num_seqs, max_subblocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [T, group, D] (final) or [num_splits, T, group, D] float32 (partial)
    lse_ptr,  # [num_splits, T, group] float32 (partial only)
    scale,
    group,
    num_tokens,
    split_len,
    stride_qt,
    stride_qg,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    stride_table,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PARTIAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * G_PAD)
    token = q_block * BLOCK_Q + rows // G_PAD
    head = rows % G_PAD
    row_valid = (token < q_len) & (head < group)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_SIZE
    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qg
    q = tl.load(
        q_ptr + q_rows[:, None] + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0
    )

    if CAUSAL:
        last_visible = seq_len - q_len + token
        kv_end = tl.minimum(seq_len, seq_len - q_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q))
    else:
        last_visible = tl.zeros_like(token) + seq_len - 1
        kv_end = seq_len
    kv_start = split * split_len
    kv_end = tl.minimum(kv_end, kv_start + split_len)

    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, BLOCK_D], tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_valid = keys < kv_end
        subblocks = tl.load(tables_ptr + seq * stride_table + keys // BLOCK_SIZE, mask=key_valid, other=0)
        offsets = keys % BLOCK_SIZE
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(
            k_ptr
            + subblocks.to(tl.int64)[:, None] * stride_kb
            + (offsets * stride_kt)[:, None]
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = key_valid[None, :] & (keys[None, :] <= last_visible[:, None]) & row_valid[:, None]
        logits = tl.where(visible, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
        p = tl.exp(logits - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(
            v_ptr
            + subblocks.to(tl.int64)[:, None] * stride_vb
            + (offsets * stride_vt)[:, None]
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_rows = (q_start + token).to(tl.int64) * group + head
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if PARTIAL:
        part = split.to(tl.int64) * num_tokens * group + out_rows
        tl.store(out_ptr + part[:, None] * HEAD_SIZE + dims[None, :], out, mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_valid)
    else:
        tl.store(
            out_ptr + out_rows[:, None] * HEAD_SIZE + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


@triton.jit
def _merge_splits_kernel(
    part_ptr,  # [num_splits, R, D] float32, R = T * group
    lse_ptr,  # [num_splits, R] float32
    out_ptr,  # [R, D]
    num_rows,
    num_splits,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_valid = rows < num_rows
    dims = tl.arange(0, BLOCK_D)
    mask = row_valid[:, None] & (dims[None, :] < HEAD_SIZE)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(lse_ptr + s * num_rows + rows, mask=row_valid, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(num_splits):
        w = tl.exp(tl.load(lse_ptr + s * num_rows + rows, mask=row_valid, other=float("-inf")) - m_safe)
        part = tl.load(
            part_ptr + (s * num_rows + rows)[:, None] * HEAD_SIZE + dims[None, :], mask=mask, other=0.0
        )
        acc += w[:, None] * part
        total += w
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * HEAD_SIZE + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def tile_config(element_size: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the attention kernel for a cache element size, D <= 128.

    From ``ptxas -v`` (tests/kernels/triton_aot.py), fp16 decode with 64-key tiles: 8 warps use 80
    registers per thread on sm_80 and sm_90, and 4 warps use 119/158; no configuration spills. 128-key
    prefill tiles spill on sm_80. 64-key fp32 tiles need about 115 KB of shared memory in prefill, more
    than sm_86/89 have, so fp32 uses 32 keys. This still has to be tuned on hardware.
    """
    return (64, 8) if element_size <= 2 else (32, 8)


# Key-range splits, from the H100 sweep of 2026-11-27 (18 decode shapes at batch 1-16,
# docs/history/2026-11-27-benchmarks-h100-kernels-and-datapath.md):
# the fastest split count gave each program 70-600 keys at batch 1-4 and kept ~4 programs per SM; batch 64
# (512 programs of 8 KV heads) was at 0.89-1.06 of flash SDPA with one split.
MIN_KEYS_PER_SPLIT = 128
PROGRAMS_PER_SM = 4
MAX_SPLITS = 32


def split_count(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Key ranges per sequence: 1 once the programs fill the GPU twice over, else enough splits for about
    ``PROGRAMS_PER_SM`` programs per SM, each with at least ``MIN_KEYS_PER_SPLIT`` keys (at most 32)."""
    if num_programs >= 2 * num_sms:
        return 1
    by_occupancy = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(num_programs, 1))
    by_length = triton.cdiv(max_seq_len, MIN_KEYS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def choose_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Key-range splits so that a small batch of long sequences still fills the GPU (1 on CPU)."""
    if device.type != "cuda":
        return 1
    return split_count(
        num_programs, max_seq_len, torch.cuda.get_device_properties(device).multi_processor_count
    )


def ragged_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    subblock_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """[T, group, D] attention output; see ``vllm_kvevict.layout.kernels.reference.ragged_paged_attention``.

    query_start_loc [num_seqs + 1] int32 (required here). max_query_len / max_seq_len spare a device sync
    when the caller knows them. num_splits forces the number of key ranges (default: by occupancy);
    block_n / num_warps override ``tile_config`` (tuning).
    """
    num_tokens, group, head_size = query.shape
    num_seqs = subblock_tables.shape[0]
    default_block_n, default_warps = tile_config(query.element_size())
    block_n = default_block_n if block_n is None else block_n
    num_warps = default_warps if num_warps is None else num_warps
    out = torch.empty(num_tokens, group, head_size, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    g_pad = triton.next_power_of_2(group)
    # tl.dot wants >= 16 rows: decode packs the group, prefill adds query tokens
    block_q = max(1, min(triton.next_power_of_2(max(max_query_len, 1)), 64 // g_pad))
    block_q = max(block_q, triton.cdiv(16, g_pad))
    q_blocks = triton.cdiv(max(max_query_len, 1), block_q)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs * q_blocks, max_seq_len, query.device)
    split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    partial = num_splits > 1
    if partial:
        target = torch.empty(
            num_splits, num_tokens, group, head_size, dtype=torch.float32, device=query.device
        )
        lse = torch.full(
            (num_splits, num_tokens, group), float("-inf"), dtype=torch.float32, device=query.device
        )
    else:
        target, lse = out, out  # lse unused
    _ragged_attention_kernel[(num_seqs, q_blocks, num_splits)](
        query,
        k_cache,
        v_cache,
        subblock_tables,
        seq_lens,
        query_start_loc,
        target,
        lse,
        scale,
        group,
        num_tokens,
        split_len,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        subblock_tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_SIZE=head_size,
        BLOCK_D=triton.next_power_of_2(head_size),
        BLOCK_Q=block_q,
        G_PAD=g_pad,
        BLOCK_N=block_n,
        num_warps=num_warps,
        CAUSAL=causal,
        PARTIAL=partial,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    if partial:
        rows = num_tokens * group
        _merge_splits_kernel[(triton.cdiv(rows, 16),)](
            target,
            lse,
            out,
            rows,
            num_splits,
            HEAD_SIZE=head_size,
            BLOCK_D=triton.next_power_of_2(head_size),
            BLOCK_R=16,
        )
    return out
