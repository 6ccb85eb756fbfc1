"""``reads_values``: a caller that reads a layer from the cache (the shared-prefix and per-chunk re-scores)
leaves the values out for a policy that reads none. For every registered method, and for the rules that
judge a prompt between chunks, the declaration must hold: without values the same tokens are kept, or the
method refuses with an error naming itself (never a silently different choice)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from policy_layers import random_layer

from vllm_kvevict.policies.base import EvictionPolicy, reads_values
from vllm_kvevict.policies.between_chunks import KeepTail, between_chunks
from vllm_kvevict.policies.registry import build_policy, method_names

N, FIXED, BUDGET = 160, 48, 40
#: the methods whose own scores read values: CriticalKV (||V W_O||), Expected Attention (value norms) and
#: the learned scorer (its features include the value)
VALUE_READERS = {
    "critical-snapkv",
    "critical-ada-snapkv",
    "expected-attention",
    "ada-expected-attention",
    "kvzap",
    "ada-kvzap",
}


def judged_without_values(
    policy: EvictionPolicy, fixed: int, budget: int = BUDGET
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept masks [H, N] of ``policy`` on one random layer, with its values and without them."""
    layer = random_layer(n=N, w=32, seed=11)
    with_values = policy.select_after(layer, budget, fixed)
    without = policy.select_after(dataclasses.replace(layer, values=None), budget, fixed)
    return with_values.to_mask(N), without.to_mask(N)


@pytest.mark.parametrize("method", method_names())
@pytest.mark.parametrize("fixed", [0, FIXED])
def test_a_method_that_declares_no_value_reads_keeps_the_same_tokens_without_them(method, fixed):
    policy = build_policy(method)
    if reads_values(policy):
        with pytest.raises(ValueError, match="reads the layer's values, but the caller left them out"):
            judged_without_values(policy, fixed)
        return
    with_values, without = judged_without_values(policy, fixed)
    assert torch.equal(with_values, without)


def test_the_value_readers_are_the_methods_that_weigh_by_values():
    readers = {name for name in method_names() if reads_values(build_policy(name))}
    assert readers == VALUE_READERS & set(method_names())


@pytest.mark.parametrize(
    "method", ["ada-snapkv", "critical-ada-snapkv", "streamingllm", "expected-attention"]
)
@pytest.mark.parametrize("rule", ["window", "keydiff", "blend"])
def test_the_rules_between_chunks_declare_what_they_compose(method, rule):
    policy = KeepTail(between_chunks(build_policy(method), rule), tail=8)
    if reads_values(policy):
        with pytest.raises(ValueError, match="reads the layer's values"):
            judged_without_values(policy, 0, budget=2 * BUDGET)
        return
    with_values, without = judged_without_values(policy, 0, budget=2 * BUDGET)
    assert torch.equal(with_values, without)
