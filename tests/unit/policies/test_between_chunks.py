"""KeyDiff, K-norm and the selections that judge a prompt between chunks (``policies/between_chunks.py``)."""

from __future__ import annotations

import pytest
import torch
from policy_layers import random_layer

from vllm_kvevict.policies import (
    AdaKV,
    ExpectedAttention,
    KeptTokens,
    KeyDiff,
    KNorm,
    LayerKV,
    QueryStatistics,
    SnapKV,
    build_policy,
)
from vllm_kvevict.policies.between_chunks import (
    BETWEEN_KINDS,
    LONG_SPAN,
    LONG_SPAN_FROM,
    BetweenRule,
    Blend,
    KeepTail,
    between_chunks,
)


def clustered_layer(n: int = 40, odd: tuple[int, ...] = (9, 23)) -> LayerKV:
    """One KV head whose keys all point along e0 with small noise, except tokens ``odd`` along e1."""
    g = torch.Generator().manual_seed(1)
    keys = torch.zeros(1, n, 8)
    keys[0, :, 0] = 1.0
    keys[0, :, 2:] = 0.05 * torch.randn(n, 6, generator=g)
    for token in odd:
        keys[0, token] = torch.zeros(8)
        keys[0, token, 1] = 1.0
    return LayerKV(keys=keys, values=torch.randn(1, n, 8, generator=g), queries=torch.zeros(1, 0, 8))


def test_keydiff_keeps_the_keys_unlike_the_rest_then_sinks_and_window() -> None:
    layer = clustered_layer()
    kept = KeyDiff(window=4, sinks=2, span_after=0).select(layer, 8)
    assert kept.head(0).tolist() == [0, 1, 9, 23, 36, 37, 38, 39]


def test_keydiff_without_sinks_or_window_ranks_by_minus_the_cosine_to_the_mean_key() -> None:
    layer = random_layer(kv_heads=2, n=30, w=0)
    scores = KeyDiff(window=0, sinks=0, span_after=0).score(layer, 10)
    keys = torch.nn.functional.normalize(layer.keys, dim=-1)
    anchor = keys.mean(dim=1, keepdim=True)
    expected = -torch.nn.functional.cosine_similarity(layer.keys, anchor, dim=-1)
    torch.testing.assert_close(scores, expected)


def test_keydiff_needs_no_queries_and_refuses_a_budget_below_what_it_always_keeps() -> None:
    policy = KeyDiff(window=8, sinks=4)
    assert policy.query_window(100) == 0
    with pytest.raises(ValueError, match="below the 12 tokens it always keeps"):
        policy.select(clustered_layer(), 11)
    with pytest.raises(ValueError, match="window=-1"):
        KeyDiff(window=-1)


def test_knorm_keeps_the_smallest_keys_then_sinks_and_window() -> None:
    layer = random_layer(kv_heads=2, n=30, w=0)
    scores = KNorm(window=0, sinks=0, span_after=0).score(layer, 10)
    torch.testing.assert_close(scores, -layer.keys.norm(dim=-1))
    small = clustered_layer()
    small.keys[0, (5, 17)] *= 0.1  # two short keys among unit-length ones
    kept = KNorm(window=4, sinks=2, span_after=2).select(small, 12)
    assert kept.head(0).tolist() == [0, 1, 5, 6, 7, 17, 18, 19, 36, 37, 38, 39]


def test_blend_keeps_its_first_share_by_the_first_scores_and_the_rest_by_the_second() -> None:
    layer = random_layer(kv_heads=2, n=60, w=32)
    first, second = SnapKV(window=8, kernel=1, span_after=0), KeyDiff(window=0, sinks=0, span_after=0)
    kept = Blend(first, second, first_share=0.5).select(layer, 20)
    assert kept.counts.tolist() == [20, 20]
    first_scores, second_scores = first.score(layer, 20), second.score(layer, 20)
    for head in range(2):
        chosen = set(kept.head(head).tolist())
        by_first = set(first_scores[head].topk(10).indices.tolist())
        assert by_first <= chosen
        rest = torch.tensor(sorted(set(range(60)) - by_first))
        by_second = rest[second_scores[head, rest].topk(10).indices]
        assert chosen == by_first | set(by_second.tolist())


def test_between_chunks_takes_out_ada_allocation_and_judges_as_told() -> None:
    ada = build_policy("ada-snapkv", window=16)
    assert isinstance(ada, AdaKV)
    assert between_chunks(ada, "window") == ada.inner
    assert between_chunks(ada, "keydiff") == KeyDiff(window=16)
    blend = between_chunks(ada)
    assert between_chunks(ada, "blend") == blend
    assert isinstance(blend, Blend) and blend.first == ada.inner and blend.second == KeyDiff(window=16)
    streaming = between_chunks(build_policy("streamingllm"), "blend")
    assert isinstance(streaming, Blend) and streaming.second == KeyDiff(window=32)  # KeyDiff's own window
    with pytest.raises(ValueError, match="between='question' is not valid; choose one of window"):
        between_chunks(ada, "question")


def test_a_rule_sets_the_blend_share_and_the_keydiff_span() -> None:
    ada = build_policy("ada-snapkv", window=16)
    blend = between_chunks(ada, BetweenRule("blend", share=0.25, span_after=16))
    assert blend == Blend(ada.inner, KeyDiff(window=16, span_after=16), first_share=0.25)
    assert between_chunks(ada, BetweenRule("keydiff", span_after=0)) == KeyDiff(window=16, span_after=0)
    assert between_chunks(ada, BetweenRule()) == between_chunks(ada)  # blend, 0.5, span by budget
    kept = blend.select(random_layer(kv_heads=3, n=200, w=32), 64)
    assert kept.counts.tolist() == [64, 64, 64]
    with pytest.raises(ValueError, match="between_share=1.5 is not valid"):
        BetweenRule(share=1.5)
    with pytest.raises(ValueError, match="between_span=-1 is not valid"):
        BetweenRule(span_after=-1)
    with pytest.raises(
        ValueError,
        match="between_scorer='norm' is not valid; choose one of keydiff, knorm, expected-attention",
    ):
        BetweenRule(scorer="norm")


def test_the_key_score_of_a_blend_and_of_a_key_kind() -> None:
    ada = build_policy("ada-snapkv", window=16)
    by_norm = between_chunks(ada, BetweenRule("blend", scorer="knorm"), 2048)
    assert by_norm == Blend(ada.inner, KNorm(window=16, span_after=LONG_SPAN))
    assert between_chunks(ada, "knorm", 100) == KNorm(window=16)
    assert between_chunks(ada, BetweenRule("knorm", scorer="keydiff")) == KNorm(window=16)  # kind wins
    assert BetweenRule("window", scorer="knorm").describe() == "between=window"


def test_an_open_span_is_long_once_keydiff_chooses_enough_tokens_per_head() -> None:
    """blend at share 0.5 hands KeyDiff half the budget: 2 x LONG_SPAN_FROM is where the long span starts;
    keydiff alone takes it all; a span given is kept at every budget."""
    ada = build_policy("ada-snapkv")
    short, long = KeyDiff.span_after, LONG_SPAN
    budgets = (600, 1023, 1024, 1536)
    spans = {budget: between_chunks(ada, "blend", budget).second.span_after for budget in budgets}
    assert spans == {600: short, 1023: short, 1024: long, 1536: long}
    assert between_chunks(ada, "blend").second.span_after == short  # budget unknown
    assert between_chunks(ada, "keydiff", LONG_SPAN_FROM).span_after == long
    assert between_chunks(ada, "keydiff", LONG_SPAN_FROM - 1).span_after == short
    assert between_chunks(ada, BetweenRule(span_after=3), 4000).second.span_after == 3


@pytest.mark.parametrize("kind", BETWEEN_KINDS)
def test_every_kind_keeps_the_same_count_in_every_head(kind: str) -> None:
    layer = random_layer(kv_heads=3, n=200, w=32)
    kept = between_chunks(build_policy("ada-snapkv"), kind).select(layer, 64)
    assert kept.counts.tolist() == [64, 64, 64]
    assert set(range(168, 200)) <= set(kept.head(0).tolist())  # the newest window is held for the next chunk


def test_keydiff_span_after_keeps_the_run_after_a_distinctive_key() -> None:
    layer = clustered_layer(odd=(9,))
    kept = KeyDiff(window=4, sinks=2, span_after=3).select(layer, 10)
    assert kept.head(0).tolist() == [0, 1, 9, 10, 11, 12, 36, 37, 38, 39]


def test_kept_tokens_to_mask_is_from_mask_inverted() -> None:
    keep = torch.rand(3, 40, generator=torch.Generator().manual_seed(2)) > 0.6
    assert torch.equal(KeptTokens.from_mask(keep).to_mask(40), keep)


def test_blend_takes_a_wrapped_methods_own_selection_first() -> None:
    layer = random_layer(kv_heads=2, n=120, w=32)
    critical = build_policy("critical-snapkv")
    kept = between_chunks(critical, "blend").select(layer, 64)
    assert kept.counts.tolist() == [64, 64]
    first = critical.select(layer, 32).to_mask(120)
    assert bool((kept.to_mask(120) >= first).all())


def test_expected_attention_judges_between_chunks_with_the_method_window_and_the_rule_span() -> None:
    ada = build_policy("ada-snapkv", window=16)
    assert between_chunks(ada, "expected-attention", 100) == ExpectedAttention(window=16, span_after=8)
    blend = between_chunks(ada, BetweenRule("blend", scorer="expected-attention"), 2048)
    assert blend == Blend(ada.inner, ExpectedAttention(window=16, span_after=LONG_SPAN))


def test_expected_attention_between_chunks_reads_the_statistics_carried_in_the_layer() -> None:
    """The held entries' LayerKV carries every query seen so far; the chunk's own window is not enough."""
    layer = random_layer(kv_heads=2, n=120, w=120, d=16, seed=9)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    stats = QueryStatistics(inv_freq, sinks=4)
    for start in range(0, 120, 40):  # three chunks of queries, merged as they arrive
        stats.update(layer.queries[:, start : start + 40], torch.arange(start, start + 40))
    window_only = LayerKV(
        keys=layer.keys, values=layer.values, queries=layer.queries[:, -32:], rope_inv_freq=inv_freq
    )
    carried = LayerKV(
        keys=layer.keys, values=layer.values, queries=layer.queries[:, -32:], query_statistics=stats
    )
    everything = LayerKV(keys=layer.keys, values=layer.values, queries=layer.queries, rope_inv_freq=inv_freq)
    scorer = between_chunks(build_policy("snapkv"), "expected-attention", 48)
    assert torch.equal(scorer.select(carried, 48).indices, scorer.select(everything, 48).indices)
    assert not torch.equal(scorer.score(carried, 48), scorer.score(window_only, 48))


def test_keep_tail_holds_the_newest_entries_and_lets_the_scorer_choose_among_the_rest() -> None:
    layer = random_layer(kv_heads=3, n=100, w=32, d=16, seed=10)
    scorer = KeyDiff(window=8, sinks=4, span_after=0)
    kept = KeepTail(scorer, tail=30).select(layer, 50)
    assert kept.counts.tolist() == [50, 50, 50]
    front = LayerKV(keys=layer.keys[:, :70], values=layer.values[:, :70], queries=layer.queries)
    alone = scorer.select(front, 20)
    for head in range(3):
        assert kept.head(head).tolist() == alone.head(head).tolist() + list(range(70, 100))
    assert KeepTail(scorer, tail=30).min_budget == 42
    assert KeepTail(scorer, tail=30).select(layer, 100).total == 300  # nothing to evict


def test_keep_tail_lets_a_query_before_the_tail_see_only_the_entries_up_to_it() -> None:
    """A tail shorter than the window: the window's first queries lie before it and must not see the
    entries between them and the tail (SnapKV's scores of the front equal those with their true positions)."""
    layer = random_layer(kv_heads=2, n=100, w=32, d=16, seed=11)
    inner = build_policy("snapkv", window=32, span_after=0)
    kept = KeepTail(inner, tail=10).select(layer, 50)
    front = LayerKV(
        keys=layer.keys[:, :90],
        values=layer.values[:, :90],
        queries=layer.queries,
        query_positions=torch.arange(68, 100).clamp(max=89),
    )
    alone = inner.select(front, 40)
    for head in range(2):
        assert kept.head(head).tolist() == alone.head(head).tolist() + list(range(90, 100))
