"""The torch reference ops against independent dense computations, and the paged views they rely on."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import BLOCK_SIZE, compaction_plan, paged_sequences, query_start_loc

from vllm_kvevict.layout.kernels import reference
from vllm_kvevict.layout.kernels.views import (
    from_head_major,
    head_major_rows,
    subblock_tables_from_block_tables,
    subblock_view,
    to_head_major,
)

# --- compaction -----------------------------------------------------------------------------------------


def naive_compaction(caches: list[torch.Tensor], src, dst, layer) -> list[torch.Tensor]:
    """Row by row from a snapshot: what compaction means when sources and destinations overlap."""
    before = [c.clone() for c in caches]
    after = [c.clone() for c in caches]
    bs = caches[0].shape[-2]
    for s, d, layer_id in zip(src.tolist(), dst.tolist(), layer.tolist(), strict=True):
        after[layer_id][..., d // bs, d % bs, :] = before[layer_id][..., s // bs, s % bs, :]
    return after


def test_compaction_with_overlapping_slots_reads_every_source_before_writing():
    caches = [torch.randn(2, 12, BLOCK_SIZE, 32) for _ in range(3)]  # 3 layers, K and V planes
    src, dst, layer = compaction_plan(3, 12, BLOCK_SIZE, kept_fraction=0.4)
    assert len(set(src.tolist()) & set(dst.tolist())) > 0, "the plan must overlap to test anything"
    expected = naive_compaction(caches, src, dst, layer)
    reference.compact_subblocks(caches, src, dst, layer)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)


def test_compaction_chain_where_each_destination_is_the_next_source():
    cache = torch.arange(4 * BLOCK_SIZE * 8, dtype=torch.float32).reshape(4, BLOCK_SIZE, 8)
    src = torch.arange(1, 40)
    dst = torch.arange(0, 39)  # slide every row one slot down, across sub-block boundaries
    expected = naive_compaction([cache], src, dst, torch.zeros_like(src))[0]
    reference.compact_subblocks(cache, src, dst)
    assert torch.equal(cache, expected)
    assert torch.equal(cache.reshape(-1, 8)[38], torch.arange(39 * 8, 40 * 8, dtype=torch.float32))


def test_compaction_writes_through_a_strided_view_of_a_packed_layer():
    # a CPU-style layer [num_blocks, H, bs, 2D]: K is the first half of each row, a strided view
    layer = torch.randn(3, 2, BLOCK_SIZE, 2 * 16)
    k_view = layer.view(6, BLOCK_SIZE, 32)[..., :16]
    v_before = layer.view(6, BLOCK_SIZE, 32)[..., 16:].clone()
    src, dst = torch.tensor([5, 40, 77]), torch.tensor([0, 1, 2])
    expected = k_view.reshape(-1, 16)[src].clone()
    reference.compact_subblocks(k_view, src, dst)
    assert torch.equal(layer.view(6 * BLOCK_SIZE, 32)[:3, :16], expected)
    assert torch.equal(layer.view(6, BLOCK_SIZE, 32)[..., 16:], v_before), "V must be untouched"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dst=torch.tensor([3, 3]), layer=torch.tensor([1, 1])), r"dst_slots repeats a \(layer, slot\)"),
        (dict(src=torch.tensor([0, 10_000])), r"src_slots holds values in \[0, 10000\], valid are \[0, 64\)"),
        (dict(layer=torch.tensor([0, 2])), r"layer_idx holds values in \[0, 2\], valid are \[0, 2\)"),
        (dict(layer=None), "layer_idx must say"),
        (dict(src=torch.tensor([0.0, 1.0])), "int32/int64"),
    ],
)
def test_compaction_rejects_bad_plans_naming_the_value(kwargs, message):
    caches = [torch.zeros(4, BLOCK_SIZE, 8) for _ in range(2)]
    args = dict(src=torch.tensor([0, 1]), dst=torch.tensor([2, 3]), layer=torch.tensor([0, 1]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        reference.compact_subblocks(caches, args["src"], args["dst"], args["layer"])


def test_compaction_rejects_layers_of_different_shapes():
    with pytest.raises(ValueError, match="differs from layer cache 0"):
        reference.compact_subblocks(
            [torch.zeros(4, BLOCK_SIZE, 8), torch.zeros(5, BLOCK_SIZE, 8)],
            torch.tensor([0]),
            torch.tensor([1]),
            torch.tensor([1]),
        )


# --- ragged paged attention -------------------------------------------------------------------------------


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [q_len, group, D], k/v [n, D] -> [q_len, group, D] via SDPA with a bottom-right causal mask."""
    q_len, n = q.shape[0], k.shape[0]
    if n == 0:
        return torch.zeros_like(q)
    mask = None
    if causal:
        mask = torch.arange(n)[None, :] <= (n - q_len + torch.arange(q_len))[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k[None].float().expand(q.shape[1], -1, -1),
        v[None].float().expand(q.shape[1], -1, -1),
        attn_mask=mask,
    )
    return out.transpose(0, 1).to(q.dtype)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "causal"),
    [
        ([1, 15, 16, 17, 40], [1, 1, 1, 1, 1], True),  # decode, lengths around a sub-block boundary
        ([5, 33, 20], [5, 7, 1], True),  # prefill chunks on a compacted cache
        ([3, 18], [2, 4], False),
    ],
)
def test_ragged_attention_equals_dense_attention_per_sequence(group, seq_lens, query_lens, causal):
    case = paged_sequences(seq_lens, head_size=32, seed=len(seq_lens) + group)
    query = torch.randn(sum(query_lens), group, 32)
    starts = query_start_loc(query_lens)
    out = reference.ragged_paged_attention(
        query, case.k_cache, case.v_cache, case.subblock_tables, case.seq_lens, starts, causal=causal
    )
    for i in range(len(seq_lens)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        want = dense_attention(query[rows], case.keys[i], case.values[i], causal)
        torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)


def test_ragged_attention_of_an_empty_sequence_is_zero():
    case = paged_sequences([0, 4], head_size=32)
    query = torch.randn(2, 3, 32)
    out = reference.ragged_paged_attention(
        query, case.k_cache, case.v_cache, case.subblock_tables, case.seq_lens, causal=False
    )
    assert torch.equal(out[0], torch.zeros(3, 32))
    assert out[1].abs().sum() > 0


def test_ragged_attention_rejects_lengths_beyond_the_table():
    case = paged_sequences([20], head_size=32)
    with pytest.raises(ValueError, match=r"seq_lens holds values in \[50, 50\], valid are \[0, 48\]"):
        reference.ragged_paged_attention(
            torch.randn(1, 1, 32), case.k_cache, case.v_cache, case.subblock_tables, torch.tensor([50])
        )


# --- observation-window scores ------------------------------------------------------------------------------


def naive_window_scores(queries, keys, pool_kernel, pool_kind, num_pooled=None) -> torch.Tensor:
    """queries [group, w, D], keys [n, D] -> [n]: the full n x n-style definition, written out."""
    group, w, d = queries.shape
    n = keys.shape[0]
    positions = torch.arange(n - w, n)
    logits = queries.float() @ keys.float().T / math.sqrt(d)  # [group, w, n]
    logits = logits.masked_fill(torch.arange(n)[None, None, :] > positions[None, :, None], float("-inf"))
    per_head = torch.softmax(logits, dim=-1).mean(dim=1)  # [group, n]
    pooled_len = n if num_pooled is None else num_pooled
    if pool_kernel > 1 and pooled_len:
        pool = F.max_pool1d if pool_kind == "max" else F.avg_pool1d
        head = pool(per_head[:, None, :pooled_len], pool_kernel, 1, pool_kernel // 2)[:, 0]
        per_head = torch.cat([head, per_head[:, pooled_len:]], dim=-1)
    return per_head.mean(dim=0)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(("pool_kernel", "pool_kind"), [(7, "max"), (5, "avg"), (1, "max")])
def test_window_scores_equal_the_naive_definition(group, pool_kernel, pool_kind):
    seq_lens, window = [8, 17, 33, 50], 8
    case = paged_sequences(seq_lens, head_size=32, seed=group)
    queries = torch.randn(len(seq_lens), group, window, 32)
    num_pooled = torch.tensor([n - window for n in seq_lens])
    scores = reference.paged_window_scores(
        queries,
        case.k_cache,
        case.subblock_tables,
        case.seq_lens,
        num_pooled=num_pooled,
        pool_kernel=pool_kernel,
        pool_kind=pool_kind,
    )
    assert scores.shape == (len(seq_lens), max(seq_lens))
    for i, n in enumerate(seq_lens):
        want = naive_window_scores(queries[i], case.keys[i], pool_kernel, pool_kind, n - window)
        torch.testing.assert_close(scores[i, :n], want, atol=1e-6, rtol=1e-5)
        assert torch.equal(scores[i, n:], torch.zeros(max(seq_lens) - n))


def test_window_scores_reject_an_unknown_pooling_kind():
    case = paged_sequences([10], head_size=32)
    with pytest.raises(ValueError, match=r"pool_kind 'median' is not one of \('max', 'avg'\)"):
        reference.paged_window_scores(
            torch.randn(1, 1, 4, 32), case.k_cache, case.subblock_tables, case.seq_lens, pool_kind="median"
        )


# --- views ------------------------------------------------------------------------------------------------


def test_subblock_view_addresses_block_times_heads_plus_head():
    heads = 3
    hnd = torch.randn(2, 5, heads, BLOCK_SIZE, 8)  # [K/V, num_blocks, H, bs, D]
    view = subblock_view(hnd, heads)
    assert view.shape == (2, 5 * heads, BLOCK_SIZE, 8)
    assert view.data_ptr() == hnd.data_ptr()
    assert torch.equal(view[1, 4 * heads + 2], hnd[1, 4, 2])


def test_subblock_tables_of_an_uncompacted_cache_map_each_head_into_every_block():
    tables = subblock_tables_from_block_tables(torch.tensor([[7, 2], [4, 0]], dtype=torch.int32), 3)
    assert tables.tolist() == [[21, 6], [22, 7], [23, 8], [12, 0], [13, 1], [14, 2]]


def test_head_major_regrouping_gives_each_request_and_head_its_own_sequence():
    heads, group, d = 3, 2, 4
    request_starts = torch.tensor([0, 2, 7, 8], dtype=torch.int32)  # requests of 2, 5 and 1 tokens
    query = torch.randn(8, heads * group, d)
    rows, seq_loc = head_major_rows(request_starts, heads)
    per_sequence = to_head_major(query, rows)
    assert seq_loc.tolist() == [0, 2, 4, 6, 11, 16, 21, 22, 23, 24]
    # sequence (request 1, head 2) = tokens 2..6, query heads 4 and 5
    seq = 1 * heads + 2
    assert torch.equal(per_sequence[seq_loc[seq] : seq_loc[seq + 1]], query[2:7, 4:6])
    assert torch.equal(from_head_major(per_sequence, rows), query)


def test_head_major_attention_equals_per_request_gqa_attention():
    """The regrouped batch through ragged attention = ordinary GQA attention of each request."""
    heads, group, d, lens = 3, 2, 32, [5, 1]
    request_starts = torch.tensor([0, 5, 6], dtype=torch.int32)
    # each request's cache: 9 and 4 tokens per head, all heads alike in length (no eviction yet)
    seq_lens = [9] * heads + [4] * heads
    case = paged_sequences(seq_lens, head_size=d, seed=3)
    query = torch.randn(sum(lens), heads * group, d)
    rows, seq_loc = head_major_rows(request_starts, heads)
    out = reference.ragged_paged_attention(
        to_head_major(query, rows), case.k_cache, case.v_cache, case.subblock_tables, case.seq_lens, seq_loc
    )
    out = from_head_major(out, rows)
    for r, start in enumerate([0, 5]):
        q = query[start : start + lens[r]].view(lens[r], heads, group, d)
        for h in range(heads):
            want = dense_attention(q[:, h], case.keys[r * heads + h], case.values[r * heads + h], causal=True)
            torch.testing.assert_close(out[start : start + lens[r], h * group : (h + 1) * group], want)
