"""One matrix over every registered method: the contract of ``EvictionPolicy.select`` holds for all.

Adding a method to the registry adds it here.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from policy_layers import random_layer

from vllm_kvevict.policies import KeptTokens, LayerKV, build_policy, method_names

SMALL = {"window": 8}  # keeps the matrix fast; streamingllm takes sinks instead
GROUPS = (1, 3, 4)


def small_policy(name: str):
    params = {"sinks": 4} if name == "streamingllm" else dict(SMALL)
    return build_policy(name, **params)


def layer_for(name: str, n: int, group: int, dtype: torch.dtype, layer_idx: int = 1) -> LayerKV:
    policy = small_policy(name)
    return random_layer(
        kv_heads=3, group=group, n=n, w=policy.query_window(n), dtype=dtype, layer_idx=layer_idx, num_layers=4
    )


def check_contract(kept: KeptTokens, kv_heads: int, n: int, budget: int) -> None:
    assert kept.counts.dtype == torch.int64 and kept.indices.dtype == torch.int64
    assert kept.total == kv_heads * min(budget, n), "layer total must be exactly H * budget"
    assert int(kept.counts.max()) <= n
    assert kept.indices.shape == (kv_heads, int(kept.counts.max()))
    for h in range(kv_heads):
        row = kept.head(h)
        assert torch.all(row[1:] > row[:-1]), "rows are sorted and unique"
        assert int(row.min()) >= 0 and int(row.max()) < n
        assert torch.all(kept.indices[h, int(kept.counts[h]) :] == -1), "padding is -1"


@pytest.mark.parametrize("name", method_names())
@pytest.mark.parametrize("group,dtype", [(1, torch.float32), (3, torch.bfloat16), (4, torch.float32)])
@pytest.mark.parametrize("n", [37, 64])
def test_select_keeps_exactly_the_budget_sorted_unique_with_window(
    name: str, group: int, dtype: torch.dtype, n: int
) -> None:
    policy = small_policy(name)
    layer = layer_for(name, n, group, dtype)
    for budget in (policy.min_budget or 1, 13, n - 1):
        budget = max(budget, policy.min_budget)
        kept = policy.select(layer, budget)
        check_contract(kept, 3, n, budget)
        forced = policy.always_kept(n, budget)
        for h in range(3):
            assert set(forced.tolist()) <= set(kept.head(h).tolist()), "window/sinks always kept"


@pytest.mark.parametrize("name", method_names())
def test_budget_at_or_above_n_keeps_everything(name: str) -> None:
    policy = small_policy(name)
    layer = layer_for(name, 21, 3, torch.float32)
    for budget in (21, 40):
        kept = policy.select(layer, budget)
        assert kept.counts.tolist() == [21, 21, 21]
        assert torch.equal(kept.indices, torch.arange(21).expand(3, 21))


@pytest.mark.parametrize("name", method_names())
def test_select_is_deterministic(name: str) -> None:
    policy = small_policy(name)
    layer = layer_for(name, 45, 3, torch.float32)
    first, second = policy.select(layer, 17), small_policy(name).select(layer, 17)
    assert torch.equal(first.indices, second.indices) and torch.equal(first.counts, second.counts)


@pytest.mark.parametrize("name", method_names())
def test_budget_below_the_always_kept_tokens_is_refused(name: str) -> None:
    policy = small_policy(name)
    layer = layer_for(name, 40, 1, torch.float32)
    with pytest.raises(ValueError, match=r"budget=3 .*below"):
        policy.select(layer, 3)
    with pytest.raises(ValueError, match="budget"):
        policy.select(layer, 0)


@pytest.mark.parametrize("name", method_names())
def test_layer_budgets_sum_to_the_uniform_total(name: str) -> None:
    policy = build_policy(name)
    for n, budget, layers in itertools.product((100, 1000, 5000), (32, 64, 200, 999), (1, 2, 30)):
        per_layer = [policy.layer_budget(budget, n, i, layers) for i in range(layers)]
        assert sum(per_layer) == layers * min(budget, n)
        assert all(policy.min_budget <= b <= n or b == min(budget, n) for b in per_layer)


@pytest.mark.parametrize("name", ["pyramidkv", "ada-pyramidkv"])
def test_pyramid_budgets_shrink_with_depth(name: str) -> None:
    policy = build_policy(name, beta=4)
    per_layer = [policy.layer_budget(256, 4000, i, 30) for i in range(30)]
    assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] > 256 > per_layer[-1]


@pytest.mark.parametrize("name", ["ada-snapkv", "ada-pyramidkv", "critical-ada-snapkv"])
def test_adaptive_methods_give_ragged_budgets_with_a_safeguard(name: str) -> None:
    policy = build_policy(name, window=4, alpha=0.2)
    layer = random_layer(kv_heads=3, group=3, n=300, w=4, seed=3)
    kept = policy.select(layer, 40)
    assert kept.total == 120
    assert len(set(kept.counts.tolist())) > 1, "heads get different budgets"
    # Each head keeps at least its safeguard: its top int(alpha * budget) = 8, the 4-token window among them.
    assert int(kept.counts.min()) >= int(40 * 0.2)


@pytest.mark.parametrize("name", method_names())
def test_seeded_or_not_each_layer_uses_its_own_index(name: str) -> None:
    policy = small_policy(name)
    for layer_idx in (0, 3):
        layer = layer_for(name, 50, 3, torch.float32, layer_idx=layer_idx)
        check_contract(policy.select(layer, 20), 3, 50, 20)


def test_integer_like_budgets_are_accepted_and_floats_refused() -> None:
    import numpy as np

    policy = small_policy("snapkv")
    layer = layer_for("snapkv", 40, 3, torch.float32)
    assert policy.select(layer, np.int64(13)).total == 39
    with pytest.raises(ValueError, match=r"budget=13.0 must be an int"):
        policy.select(layer, 13.0)  # type: ignore[arg-type]
