"""``select_after``: what a request keeps of its own tokens when a prefix it shares with other requests is
kept anyway. Scored methods score the whole layer (the prefix in the softmax) and choose after it; the others
judge the tokens after the prefix as a prompt of their own."""

from __future__ import annotations

import pytest
import torch
from policy_layers import random_layer

from vllm_kvevict.policies.adakv import AdaKV
from vllm_kvevict.policies.base import KeptTokens, ScoredPolicy
from vllm_kvevict.policies.kept_masks import ada_allocation, top_k_mask
from vllm_kvevict.policies.registry import build_policy

N, FIXED, BUDGET = 160, 48, 40


@pytest.mark.parametrize(
    "method", ["snapkv", "ada-snapkv", "pyramidkv", "critical-ada-snapkv", "nacl", "keydiff", "knorm"]
)
def test_kept_tokens_lie_after_the_prefix_and_fill_the_budget(method):
    layer = random_layer(n=N, w=32, seed=3)
    kept = build_policy(method).select_after(layer, BUDGET, FIXED)
    assert int(kept.counts.sum()) == layer.num_kv_heads * BUDGET
    for head in range(layer.num_kv_heads):
        chosen = kept.head(head).tolist()
        assert chosen == sorted(set(chosen)) and all(FIXED <= i < N for i in chosen)


def test_scored_methods_rank_with_the_prefix_in_the_softmax():
    """SnapKV: the top-k after the prefix of the whole layer's scores (normalised over every key), which in
    general differs from scoring the tokens after the prefix alone."""
    layer = random_layer(n=N, w=32, seed=5)
    snapkv = build_policy("snapkv", span_after=0)
    assert isinstance(snapkv, ScoredPolicy)
    expected = KeptTokens.from_mask(top_k_mask(snapkv.score(layer, BUDGET)[:, FIXED:], BUDGET))
    kept = snapkv.select_after(layer, BUDGET, FIXED)
    assert torch.equal(kept.indices, torch.where(expected.indices >= 0, expected.indices + FIXED, -1))

    ada = build_policy("ada-snapkv")
    assert isinstance(ada, AdaKV)
    mask = ada_allocation(ada.inner.score(layer, BUDGET)[:, FIXED:], BUDGET, ada.alpha)
    kept = ada.select_after(layer, BUDGET, FIXED)
    assert torch.equal(kept.counts, mask.sum(dim=1))
    assert torch.equal(kept.to_mask(N)[:, FIXED:], mask)


def test_budget_covering_the_private_part_keeps_all_of_it():
    layer = random_layer(n=N, w=32)
    kept = build_policy("ada-snapkv").select_after(layer, N - FIXED, FIXED)
    assert kept.indices.tolist() == [list(range(FIXED, N))] * layer.num_kv_heads


def test_no_prefix_is_plain_select():
    layer = random_layer(n=N, w=32)
    policy = build_policy("snapkv")
    assert torch.equal(policy.select_after(layer, BUDGET, 0).indices, policy.select(layer, BUDGET).indices)
