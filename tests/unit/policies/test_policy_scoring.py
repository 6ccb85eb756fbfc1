"""The scoring blocks against naive full-matrix torch computations (n x n is fine at this size)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from vllm_kvevict.policies.attention_scores import (
    _column_sums,
    accumulated_attention,
    attention_statistics,
    extend_forward,
    group_mean,
    pool_scores,
    value_norms,
    window_attention,
)


def naive_attention(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[q_heads, w, n] causal softmax with KV repeated over the group, in float64."""
    group = queries.shape[0] // keys.shape[0]
    k = keys.double().repeat_interleave(group, dim=0)
    logits = queries.double() @ k.transpose(1, 2) / math.sqrt(keys.shape[2])
    hidden = torch.arange(keys.shape[1])[None, :] > positions[:, None]
    return torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)


def inputs(kv_heads: int, group: int, n: int, w: int, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(kv_heads * group, w, d, generator=g) * 2,
        torch.randn(kv_heads, n, d, generator=g) * 2,
    )


@pytest.mark.parametrize("kv_heads,group", [(1, 1), (2, 3), (3, 4)])
@pytest.mark.parametrize("chunk_size", [4096, 7, 1])
def test_window_attention_matches_full_softmax(kv_heads: int, group: int, chunk_size: int) -> None:
    queries, keys = inputs(kv_heads, group, n=29, w=5)
    expected = naive_attention(queries, keys, torch.arange(24, 29)).mean(dim=1)
    got = window_attention(queries, keys, chunk_size=chunk_size)
    assert got.dtype == torch.float32 and got.shape == (kv_heads * group, 29)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)


def test_window_attention_respects_explicit_query_positions() -> None:
    queries, keys = inputs(2, 2, n=20, w=3)
    positions = torch.tensor([3, 10, 15])
    expected = naive_attention(queries, keys, positions).mean(dim=1)
    got = window_attention(queries, keys, positions, chunk_size=4)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)
    # Tokens after the last query are invisible to every query.
    assert torch.all(got[:, 16:] == 0)


def test_window_attention_chunked_equals_unchunked_on_long_prompt() -> None:
    queries, keys = inputs(3, 3, n=5000, w=32, d=64)
    whole = window_attention(queries, keys, chunk_size=8192)
    chunked = window_attention(queries, keys, chunk_size=1000)
    torch.testing.assert_close(chunked, whole, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(whole.sum(dim=1), torch.ones(9), atol=1e-4, rtol=0)


def test_window_attention_of_bf16_inputs_is_float32_and_close() -> None:
    queries, keys = inputs(2, 3, n=40, w=6)
    got = window_attention(queries.bfloat16(), keys.bfloat16())
    expected = naive_attention(queries.bfloat16().float(), keys.bfloat16().float(), torch.arange(34, 40))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected.mean(dim=1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("query_chunk,chunk_size", [(256, 4096), (3, 5)])
def test_accumulated_attention_is_column_sum_over_all_queries(query_chunk: int, chunk_size: int) -> None:
    queries, keys = inputs(2, 3, n=23, w=23)
    expected = naive_attention(queries, keys, torch.arange(23)).sum(dim=1)
    got = accumulated_attention(queries, keys, query_chunk=query_chunk, chunk_size=chunk_size)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_attention_statistics_are_mean_and_std_of_group_rows_over_seeing_queries() -> None:
    queries, keys = inputs(2, 2, n=12, w=12)
    probs = naive_attention(queries, keys, torch.arange(12)).view(2, 2, 12, 12).mean(dim=1)  # [kv, q, n]
    mean, std, count = attention_statistics(queries, keys, query_chunk=5, chunk_size=4)
    for j in range(12):
        seen = probs[:, j:, j]  # queries at positions >= j
        assert count[j] == 12 - j
        torch.testing.assert_close(mean[:, j].double(), seen.mean(dim=1), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(std[:, j].double(), seen.std(dim=1, unbiased=False), atol=1e-5, rtol=1e-4)


def test_avg_pooling_matches_kvpress_avg_pool1d_with_zero_padding() -> None:
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    expected = F.avg_pool1d(scores[None], kernel_size=3, padding=1, stride=1)[0]
    assert torch.equal(pool_scores(scores, 3, "avg"), expected)
    # By hand: the edges count the zero padding in the divisor.
    torch.testing.assert_close(pool_scores(scores, 3, "avg"), torch.tensor([[1.0, 2.0, 3.0, 4.0, 3.0]]))


def test_max_pooling_by_hand_keeps_length_and_ignores_padding() -> None:
    scores = torch.tensor([[-1.0, -5.0, -2.0, -7.0, -3.0, -4.0, -6.0]])
    expected = torch.tensor([[-1.0, -1.0, -1.0, -2.0, -2.0, -3.0, -3.0]])
    assert torch.equal(pool_scores(scores, 5, "max"), expected)
    assert torch.equal(pool_scores(scores, 1, "max"), scores)


def test_extend_forward_by_hand_carries_each_score_over_the_next_span_tokens() -> None:
    scores = torch.tensor([[0.0, 9.0, 1.0, 0.0, 0.0, 5.0, 0.0, 0.0]])
    # out[i] = max(scores[i - 2 .. i]): the peak at 1 covers 1..3, the one at 5 covers 5..7.
    expected = torch.tensor([[0.0, 9.0, 9.0, 9.0, 1.0, 5.0, 5.0, 5.0]])
    assert torch.equal(extend_forward(scores, 2), expected)
    assert torch.equal(extend_forward(scores, 0), scores)


def test_extend_forward_keeps_plus_infinity_and_leading_axes() -> None:
    scores = torch.tensor([[[1.0, float("inf"), 0.0, 2.0]], [[3.0, 0.0, 0.0, 0.0]]])
    out = extend_forward(scores, 1)
    assert out.shape == scores.shape
    assert out[0, 0].tolist() == [1.0, float("inf"), float("inf"), 2.0]
    assert out[1, 0].tolist() == [3.0, 3.0, 0.0, 0.0]


@pytest.mark.parametrize("span", [-1, 1.5, True])
def test_extend_forward_rejects_bad_span(span: object) -> None:
    with pytest.raises(ValueError, match="span"):
        extend_forward(torch.zeros(1, 3), span)  # type: ignore[arg-type]


def test_pooling_works_on_batched_leading_axes() -> None:
    scores = torch.rand(2, 3, 11)
    pooled = pool_scores(scores, 7, "max")
    assert pooled.shape == scores.shape
    assert torch.equal(pooled[1, 2], pool_scores(scores[1, 2][None], 7, "max")[0])


@pytest.mark.parametrize("kernel,kind", [(4, "max"), (0, "avg"), (3, "median"), (True, "max")])
def test_pooling_rejects_bad_kernel_or_kind(kernel: int, kind: str) -> None:
    with pytest.raises(ValueError, match="kernel|kind"):
        pool_scores(torch.rand(1, 9), kernel, kind)


def test_group_mean_averages_each_query_group() -> None:
    scores = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 4.0], [7.0, 6.0]])
    assert torch.equal(group_mean(scores, 2), torch.tensor([[2.0, 1.0], [6.0, 5.0]]))
    assert torch.equal(group_mean(scores, 4), scores)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        group_mean(scores, 3)


@pytest.mark.parametrize("kv_heads,group", [(1, 1), (3, 3), (2, 4)])
def test_value_norms_match_per_query_head_l1_of_v_times_wo(kv_heads: int, group: int) -> None:
    g = torch.Generator().manual_seed(1)
    n, d, hidden = 13, 8, 20
    values = torch.randn(kv_heads, n, d, generator=g)
    o_proj = torch.randn(hidden, kv_heads * group * d, generator=g)
    expected = torch.zeros(kv_heads, n, dtype=torch.float64)
    for j in range(kv_heads * group):
        w_j = o_proj[:, j * d : (j + 1) * d].double()  # [hidden, d]
        expected[j // group] += (values[j // group].double() @ w_j.T).abs().sum(dim=-1) / group
    got = value_norms(values, o_proj, chunk_size=4)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)


def test_value_norms_reject_mismatched_o_proj() -> None:
    with pytest.raises(ValueError, match="o_proj"):
        value_norms(torch.rand(2, 5, 8), torch.rand(10, 20))


def test_value_norms_of_bf16_values_and_o_proj_match_float64() -> None:
    g = torch.Generator().manual_seed(3)
    values = torch.randn(3, 50, 64, generator=g).bfloat16()
    o_proj = torch.randn(576, 9 * 64, generator=g).bfloat16()
    expected = torch.zeros(3, 50, dtype=torch.float64)
    for j in range(9):
        w_j = o_proj[:, j * 64 : (j + 1) * 64].double()
        expected[j // 3] += (values[j // 3].double() @ w_j.T).abs().sum(dim=-1) / 3
    torch.testing.assert_close(value_norms(values, o_proj).double(), expected, atol=0, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [4096, 500])
def test_column_sums_one_kv_head_at_a_time_equal_all_heads_at_once(chunk_size: int) -> None:
    """The CPU walks KV heads one at a time, other devices all at once: the same sums."""
    queries, keys = inputs(4, 3, n=1200, w=32, d=64)
    positions = torch.arange(1168, 1200)
    one = _column_sums(queries, keys, positions, chunk_size, 32, heads_per_pass=1)
    two = _column_sums(queries, keys, positions, chunk_size, 32, heads_per_pass=2)
    every = _column_sums(queries, keys, positions, chunk_size, 32, heads_per_pass=4)
    torch.testing.assert_close(one, every, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(two, every, atol=1e-7, rtol=1e-6)
    expected = naive_attention(queries, keys, positions).sum(dim=1)
    torch.testing.assert_close(one.double(), expected, atol=1e-5, rtol=1e-4)
