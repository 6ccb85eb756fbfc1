"""Each method on small hand-built layers whose kept sets can be worked out by hand.

Keys are one-hot (key i = e_i), so a query ``s * e_t`` puts almost all its attention on token t.
"""

from __future__ import annotations

import pytest
import torch

from vllm_kvevict.policies import (
    H2O,
    AdaKV,
    CriticalKV,
    KeptTokens,
    LayerKV,
    NaCl,
    PyramidKV,
    RoCo,
    RocoStatistics,
    SnapKV,
    StreamingLLM,
)


def one_hot_layer(targets: list[list[dict[int, float]]], n: int = 8, kv_heads: int = 1) -> LayerKV:
    """targets[q_head][query] maps token -> strength; queries are the last len(targets[0]) positions."""
    keys = torch.eye(n)[None].repeat(kv_heads, 1, 1)
    queries = torch.zeros(len(targets), len(targets[0]), n)
    for head, rows in enumerate(targets):
        for row, weights in enumerate(rows):
            for token, strength in weights.items():
                queries[head, row, token] = strength
    return LayerKV(keys=keys, values=torch.ones(kv_heads, n, n), queries=queries)


def heads(kept: KeptTokens) -> list[list[int]]:
    return [kept.head(h).tolist() for h in range(kept.indices.shape[0])]


def test_snapkv_keeps_the_attended_tokens_and_the_window() -> None:
    layer = one_hot_layer([[{1: 12.0}, {4: 8.0}]])
    assert heads(SnapKV(span_after=0, window=2, kernel=1).select(layer, 4)) == [[1, 4, 6, 7]]


def test_snapkv_max_pooling_spreads_scores_to_neighbours_and_ties_go_low() -> None:
    layer = one_hot_layer([[{1: 12.0}, {4: 8.0}]])
    # Pooled prefix scores: tokens 0-2 all equal token 1's, tokens 3-5 token 4's; the 2 free slots go to 0, 1.
    assert heads(SnapKV(span_after=0, window=2, kernel=3, pooling="max").select(layer, 4)) == [[0, 1, 6, 7]]


def test_snapkv_span_after_keeps_the_run_that_follows_a_peak() -> None:
    layer = one_hot_layer([[{1: 12.0}, {9: 6.0}]], n=12)
    # Prefix scores (tokens 0-9): a strong peak at 1, a weak one at 9. The paper's rule keeps the two peaks
    # and the best leftovers by index; span_after=3 gives tokens 2-4 the peak's score, so the run 1-4 stays.
    assert heads(SnapKV(span_after=0, window=2, kernel=1).select(layer, 5)) == [[0, 1, 9, 10, 11]]
    assert heads(SnapKV(span_after=3, window=2, kernel=1).select(layer, 6)) == [[1, 2, 3, 4, 10, 11]]


def test_snapkv_scores_a_kv_head_by_the_mean_of_its_query_group() -> None:
    # One KV head read by two query heads: token 2 is attended by both, token 5 strongly by one only.
    layer = one_hot_layer([[{2: 6.0, 5: 9.0}], [{2: 6.0}]])
    assert heads(SnapKV(span_after=0, window=1, kernel=1).select(layer, 2)) == [[2, 7]]


def test_pyramidkv_budgets_by_hand() -> None:
    policy = PyramidKV(beta=2)
    # budget 100, n 1000: min 50, max 150, five layers step 25.
    assert [policy.layer_budget(100, 1000, i, 5) for i in range(5)] == [150, 125, 100, 75, 50]
    # n 160: max clipped to n - window = 128, min = 2 * 100 - 128 = 72.
    assert [policy.layer_budget(100, 160, i, 3) for i in range(3)] == [128, 100, 72]
    # beta 20: min 5 < window 32 -> uniform fallback.
    assert PyramidKV().layer_budget(100, 1000, 0, 5) == 100
    assert PyramidKV().layer_budget(2000, 1000, 0, 5) == 1000


def test_pyramidkv_selects_like_snapkv_at_its_layer_budget() -> None:
    layer = one_hot_layer([[{1: 12.0}, {4: 8.0}]])
    assert heads(PyramidKV(span_after=0, window=2, kernel=1).select(layer, 3)) == [[1, 6, 7]]


def test_ada_snapkv_moves_slots_to_the_head_with_spread_attention() -> None:
    spread = {1: 8.0, 2: 8.0, 3: 8.0}
    layer = one_hot_layer([[spread], [{5: 12.0}]], kv_heads=2)
    # Head 0 spreads attention over 1, 2, 3; head 1 only needs 5. Budget 3 x 2 heads = 6 slots.
    assert heads(AdaKV(SnapKV(span_after=0, window=1, kernel=1), alpha=0.2).select(layer, 3)) == [
        [1, 2, 3, 7],
        [5, 7],
    ]
    # Uniform SnapKV: 3 each, head 1 wastes a slot on a leftover (the lowest index).
    assert heads(SnapKV(span_after=0, window=1, kernel=1).select(layer, 3)) == [[1, 2, 7], [0, 5, 7]]


def test_critical_snapkv_prefers_tokens_with_large_projected_values() -> None:
    n = 8
    layer = one_hot_layer([[{1: 12.0, 2: 6.0}]])
    values = torch.ones(1, n, n)
    values[0, 4] *= 1000.0
    values[0, 6] *= 1000.0
    layer = LayerKV(layer.keys, values, layer.queries, o_proj=torch.eye(n))
    # Budget 4: stage 1 = 2 (window + token 1 by attention); stage 2 = tokens 4 and 6 (value norm x1000).
    assert heads(CriticalKV(SnapKV(span_after=0, window=1, kernel=1)).select(layer, 4)) == [[1, 4, 6, 7]]
    assert heads(SnapKV(span_after=0, window=1, kernel=1).select(layer, 4)) == [[0, 1, 2, 7]]


def test_critical_kv_needs_o_proj() -> None:
    layer = one_hot_layer([[{1: 12.0}]])
    with pytest.raises(ValueError, match="o_proj"):
        CriticalKV(SnapKV(span_after=0, window=1)).select(layer, 3)


def test_streamingllm_keeps_sinks_and_recent_tokens() -> None:
    layer = one_hot_layer([[{1: 1.0}]], n=10)
    assert heads(StreamingLLM(sinks=2).select(layer, 5)) == [[0, 1, 7, 8, 9]]
    assert StreamingLLM(sinks=2).always_kept(10, 5).tolist() == [0, 1, 7, 8, 9]


def test_h2o_keeps_heavy_hitters_accumulated_over_all_queries() -> None:
    # Queries 0-2 are zero (uniform over what they see); queries 3-5 all look at token 3.
    rows = [{} for _ in range(3)] + [{3: 12.0} for _ in range(3)]
    layer = one_hot_layer([rows], n=6)
    # Token 0 collects 1 + 1/2 + 1/3 + ...; token 3 ~3 x 0.99; window token 5.
    assert heads(H2O(window=1).select(layer, 3)) == [[0, 3, 5]]
    assert H2O(window=1).query_window(6) == 6


def test_nacl_without_random_part_is_snapkv_without_pooling(make_layer) -> None:
    layer = make_layer(kv_heads=3, group=3, n=70, w=32)
    nacl = NaCl(window=8, random_ratio=0.0).select(layer, 20)
    snap = SnapKV(span_after=0, window=8, kernel=1).select(layer, 20)
    assert torch.equal(nacl.indices, snap.indices)


def test_nacl_samples_differently_per_seed_and_repeats_per_seed(make_layer) -> None:
    layer = make_layer(kv_heads=3, group=1, n=300, w=32)
    first = NaCl(window=8, random_ratio=1.0, seed=1).select(layer, 60)
    again = NaCl(window=8, random_ratio=1.0, seed=1).select(layer, 60)
    other = NaCl(window=8, random_ratio=1.0, seed=2).select(layer, 60)
    assert torch.equal(first.indices, again.indices)
    assert not torch.equal(first.indices, other.indices)
    assert not torch.equal(first.head(0), first.head(1))


def test_nacl_random_part_goes_to_the_dominant_token() -> None:
    layer = one_hot_layer([[{3: 30.0}]], n=8)
    # Budget 2: window 1, one sampled slot; token 3 holds nearly all proxy attention.
    for seed in range(5):
        assert heads(NaCl(window=1, random_ratio=1.0, seed=seed).select(layer, 2)) == [[3, 7]]


def test_roco_without_std_scope_keeps_highest_mean_attention() -> None:
    # Uniform attention: token j's mean over the queries that see it decreases with j.
    layer = one_hot_layer([[{} for _ in range(6)]], n=6)
    assert heads(RoCo(window=1, std_ratio=0.0).select(layer, 3)) == [[0, 1, 5]]


def test_roco_std_scope_keeps_the_most_volatile_token_instead_of_the_highest_mean() -> None:
    # Token 2 gets steady attention (highest mean); token 0 is all a position-0 query sees, then fades
    # (highest std); token 1 gets one burst.
    rows = [{}, {}, {2: 4.0}, {2: 4.0}, {1: 6.0, 2: 4.0}, {2: 4.0}, {2: 4.0}, {2: 4.0}]
    layer = one_hot_layer([rows], n=8)
    stats = RocoStatistics.from_prefill(layer)
    most_volatile = int(stats.std()[0, :7].argmax())
    highest_mean = int(stats.mean()[0, :7].argmax())
    assert (most_volatile, highest_mean) == (0, 2)
    assert heads(RoCo(window=1, std_ratio=0.0).select(layer, 2)) == [[2, 7]]
    assert heads(RoCo(window=1, std_ratio=1.0).select(layer, 2)) == [[0, 7]]
    # Budget 3, std_ratio 0.5: one slot by std (token 0), one by mean (token 2).
    assert heads(RoCo(window=1, std_ratio=0.5).select(layer, 3)) == [[0, 2, 7]]


def test_roco_statistics_update_by_hand() -> None:
    stats = RocoStatistics(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2))
    stats.update(torch.tensor([[0.5, 0.5]]))
    stats.update(torch.tensor([[0.2, 0.3, 0.5]]))  # a new token appended
    torch.testing.assert_close(stats.counts, torch.tensor([[2.0, 2.0, 1.0]]))
    torch.testing.assert_close(stats.mean(), torch.tensor([[0.35, 0.4, 0.5]]))
    torch.testing.assert_close(stats.std(), torch.tensor([[0.15, 0.1, 0.0]]))
    assert stats.eviction_candidates(1, window=1, std_ratio=0.0).tolist() == [[0]]
    stats.keep(torch.tensor([[1, 2]]))
    torch.testing.assert_close(stats.mean(), torch.tensor([[0.4, 0.5]]))


def test_roco_statistics_incremental_equals_prefill(make_layer) -> None:
    from vllm_kvevict.policies.attention_scores import group_mean, window_attention

    layer = make_layer(kv_heads=2, group=3, n=30)
    head_start = LayerKV(layer.keys[:, :20], layer.values[:, :20], layer.queries[:, :20])
    stats = RocoStatistics.from_prefill(head_start)
    for position in range(20, 30):
        row = window_attention(layer.queries[:, position : position + 1], layer.keys[:, : position + 1])
        stats.update(group_mean(row, 2))
    full = RocoStatistics.from_prefill(layer)
    torch.testing.assert_close(stats.mean(), full.mean(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(stats.std(), full.std(), atol=1e-5, rtol=1e-4)


def test_roco_statistics_reject_a_shrinking_row() -> None:
    stats = RocoStatistics(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="attn_row"):
        stats.update(torch.zeros(2, 3))
