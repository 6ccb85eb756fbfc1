"""Expected Attention (``policies/expected_attention.py``): RoPE taken out of post-RoPE queries, running
query statistics that merge across chunks, and the score. Exact parity with kvpress's press is
``tests/reference/test_kvpress_parity.py``."""

from __future__ import annotations

import math

import pytest
import torch
from policy_layers import random_layer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from vllm_kvevict.policies import AdaKV, ExpectedAttention, LayerKV, QueryStatistics, build_policy
from vllm_kvevict.policies.expected_attention import LEADERBOARD_EPSILON
from vllm_kvevict.policies.query_statistics import average_rotation, rope_cos_sin, rotate_half, unrotate

D = 16
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))


def rotated(pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF Llama's RoPE applied to ``pre`` [h, t, d] at ``positions`` [t] (the independent reference)."""
    cos, sin = rope_cos_sin(INV_FREQ, positions)
    post, _ = apply_rotary_pos_emb(pre[None], pre[None], cos[None], sin[None])
    return post[0]


def test_unrotate_undoes_hf_llama_rope_at_each_position() -> None:
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(3, 40, D, generator=g)
    positions = torch.arange(100, 140)
    torch.testing.assert_close(unrotate(rotated(pre, positions), positions, INV_FREQ), pre, atol=1e-5, rtol=0)


def test_average_rotation_is_the_mean_of_the_per_position_rope_matrices() -> None:
    # Column j of position p's matrix is RoPE applied to basis vector e_j at p.
    basis = torch.eye(D)[None]  # [1, d (vectors), d]
    per_position = [rotated(basis, torch.tensor([p]).expand(D))[0].T for p in range(7, 7 + 5)]
    expected = torch.stack(per_position).mean(dim=0)
    torch.testing.assert_close(average_rotation(INV_FREQ, 7, 5, D), expected, atol=1e-6, rtol=0)


def test_partial_rotary_leaves_the_coordinates_after_the_rotary_part_alone() -> None:
    inv_freq = INV_FREQ[: D // 4]  # RoPE on the first d / 2 coordinates only
    x = torch.randn(2, 5, D)
    back = unrotate(x, torch.arange(5), inv_freq)
    torch.testing.assert_close(back[..., D // 2 :], x[..., D // 2 :])
    rotation = average_rotation(inv_freq, 3, 4, D)
    torch.testing.assert_close(rotation[D // 2 :, D // 2 :], torch.eye(D // 2))
    assert torch.equal(rotation[: D // 2, D // 2 :], torch.zeros(D // 2, D // 2))


def test_rotate_half_is_neox_layout() -> None:
    assert rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [-3.0, -4.0, 1.0, 2.0]


def test_statistics_merged_chunk_by_chunk_equal_those_of_all_queries_at_once() -> None:
    g = torch.Generator().manual_seed(1)
    pre = torch.randn(4, 300, D, generator=g) + 0.5
    positions = torch.arange(300)
    post = rotated(pre, positions)
    running = QueryStatistics(INV_FREQ, sinks=4)
    for start in range(0, 300, 64):
        running.update(post[:, start : start + 64], positions[start : start + 64])
    at_once = QueryStatistics.of(post, positions, INV_FREQ, sinks=4)
    assert running.count == at_once.count == 296 and running.seen == at_once.seen == 300
    kept = pre[:, 4:]
    torch.testing.assert_close(running.mean, kept.mean(dim=1), atol=1e-5, rtol=0)
    centred = kept - kept.mean(dim=1, keepdim=True)
    covariance = centred.transpose(1, 2) @ centred / kept.shape[1]
    torch.testing.assert_close(running.scatter / running.count, covariance, atol=1e-4, rtol=1e-4)
    mean, cov = running.future_moments(512)
    rotation = average_rotation(INV_FREQ, 300, 512, D)
    torch.testing.assert_close(mean, kept.mean(dim=1) @ rotation.T, atol=1e-5, rtol=0)
    torch.testing.assert_close(cov, rotation @ covariance @ rotation.T, atol=1e-4, rtol=1e-4)


def test_sink_positions_take_no_part_in_the_statistics() -> None:
    queries = torch.zeros(1, 6, D)
    queries[0, :4] = 100.0  # the sinks: ignored
    queries[0, 4:, 0] = 1.0  # position-independent only at angle 0, so compare un-rotated ones
    stats = QueryStatistics.of(queries, torch.arange(6), torch.zeros(D // 2), sinks=4)
    assert stats.count == 2
    torch.testing.assert_close(stats.mean[0], queries[0, 4])
    with pytest.raises(ValueError, match="no query at a position >= sinks=4"):
        QueryStatistics.of(queries[:, :4], torch.arange(4), INV_FREQ, sinks=4).future_moments(8)


def test_score_is_the_softmax_of_the_expected_logit_times_the_value_norm() -> None:
    """No RoPE (zero frequencies), one query head, queries +-q: mean 0, covariance q q^T. The logit of key k
    is then (q.k)^2 / (2 d); the score is its softmax over the non-sink keys, (+ epsilon) x ||v||."""
    q = torch.zeros(D)
    q[0] = 2.0
    queries = torch.stack([q, -q] * 5)[None]  # [1, 10, d]
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(1, 10, D, generator=g), torch.rand(1, 10, D, generator=g) + 0.1
    layer = LayerKV(keys=keys, values=values, queries=queries, rope_inv_freq=torch.zeros(D // 2))
    policy = ExpectedAttention(sinks=2, epsilon=0.0, window=0, span_after=0)
    scores = policy.score(layer, 5)
    logits = (keys[0, 2:] @ q) ** 2 / (2 * D)
    expected = torch.softmax(logits, dim=0) * values[0, 2:].norm(dim=-1)
    torch.testing.assert_close(scores[0, 2:], expected)
    assert scores[0, :2].isinf().all()
    assert math.isclose(float(policy.score(layer, 5)[0, 2:].sum()), float(expected.sum()), rel_tol=1e-6)


def test_a_key_along_the_mean_future_query_is_kept_before_the_others() -> None:
    layer = random_layer(kv_heads=1, group=2, n=40, d=D, seed=3)
    mean_query = layer.queries.mean(dim=(0, 1))  # no RoPE here (zero frequencies), no sinks
    keys = layer.keys.clone()
    keys[0, 20] = mean_query / mean_query.norm() * 12
    aligned = LayerKV(
        keys=keys, values=torch.ones_like(keys), queries=layer.queries, rope_inv_freq=torch.zeros(D // 2)
    )
    kept = ExpectedAttention(sinks=0, use_covariance=False, window=0, span_after=0).select(aligned, 1)
    assert kept.head(0).tolist() == [20]


def test_carried_statistics_replace_the_layer_queries() -> None:
    layer = random_layer(kv_heads=2, n=60, d=D, seed=4)
    stats = QueryStatistics.of(layer.queries, layer.positions(), INV_FREQ, sinks=4)
    carried = LayerKV(
        keys=layer.keys, values=layer.values, queries=torch.zeros(6, 0, D), query_statistics=stats
    )
    policy = ExpectedAttention()
    direct = LayerKV(keys=layer.keys, values=layer.values, queries=layer.queries, rope_inv_freq=INV_FREQ)
    torch.testing.assert_close(policy.score(carried, 20), policy.score(direct, 20))


def test_without_frequencies_plain_rope_with_rope_theta_is_assumed() -> None:
    layer = random_layer(kv_heads=2, n=60, d=D, seed=5)
    given = LayerKV(keys=layer.keys, values=layer.values, queries=layer.queries, rope_inv_freq=INV_FREQ)
    torch.testing.assert_close(ExpectedAttention().score(layer, 20), ExpectedAttention().score(given, 20))
    assert not torch.equal(
        ExpectedAttention(rope_theta=500.0).score(layer, 20), ExpectedAttention().score(given, 20)
    )


def test_window_and_sinks_are_always_kept_and_every_head_keeps_the_budget() -> None:
    layer = random_layer(kv_heads=3, n=80, d=D, seed=6)
    kept = ExpectedAttention(window=8, sinks=4).select(layer, 20)
    assert kept.counts.tolist() == [20, 20, 20]
    for head in range(3):
        assert {0, 1, 2, 3, *range(72, 80)} <= set(kept.head(head).tolist())
    assert ExpectedAttention().query_window(80) == 80 and ExpectedAttention(window=8).min_budget == 12


def test_registered_forms_and_their_defaults() -> None:
    plain = build_policy("expected-attention")
    assert plain == ExpectedAttention()
    assert (plain.n_future_positions, plain.sinks, plain.epsilon) == (512, 4, LEADERBOARD_EPSILON)
    assert (plain.window, plain.span_after) == (32, 8)  # the product's; kvpress's press has neither
    ada = build_policy("ada-expected-attention", epsilon=0.0, alpha=0.3)
    assert isinstance(ada, AdaKV) and ada.inner == ExpectedAttention(epsilon=0.0) and ada.alpha == 0.3
    kept = ada.select(random_layer(kv_heads=3, n=80, d=D, seed=7), 40)
    assert kept.total == 120


@pytest.mark.parametrize(
    ("field", "value"),
    [("n_future_positions", 0), ("sinks", -1), ("epsilon", 2.0), ("use_vnorm", 1), ("rope_theta", 1.0)],
)
def test_bad_parameters_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{field}={value!r} is not valid"):
        ExpectedAttention(**{field: value})
