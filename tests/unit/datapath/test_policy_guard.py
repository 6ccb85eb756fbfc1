"""The policy boundary contains every policy failure as a counted PolicyFault (issue 13, fault injection)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from prometheus_client import REGISTRY

from vllm_kvevict.datapath import policy_guard
from vllm_kvevict.datapath.policy_guard import PolicyFault, guarded_select
from vllm_kvevict.policies.base import KeptTokens, LayerKV, ScoredPolicy
from vllm_kvevict.policies.registry import build_policy

N, HEADS, BUDGET = 96, 2, 40


def layer(n: int = N, seed: int = 0) -> LayerKV:
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(HEADS, n, 8, generator=g), torch.randn(HEADS, n, 8, generator=g)
    return LayerKV(keys=keys, values=values, queries=torch.randn(HEADS * 3, 32, 8, generator=g), num_layers=2)


def fallbacks(method: str, reason: str) -> float:
    labels = {"method": method, "reason": reason}
    return REGISTRY.get_sample_value("vllm_kvevict_policy_fallbacks_total", labels) or 0.0


@dataclass(frozen=True)
class Raising(ScoredPolicy):
    name: str = "raising"

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        return torch.zeros(3)[layer.num_tokens]  # IndexError, a type the worker alone would not catch


@dataclass(frozen=True)
class NaNScoring(ScoredPolicy):
    name: str = "nan-scoring"

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        scores = torch.rand(layer.num_kv_heads, layer.num_tokens)
        scores[1, 5] = float("nan")
        return scores


@dataclass(frozen=True)
class Returning(ScoredPolicy):
    """Returns a fixed (broken) selection."""

    kept: KeptTokens | None = None
    name: str = "returning"

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        raise AssertionError("not called")

    def select(self, layer: LayerKV, budget: int) -> KeptTokens:
        assert self.kept is not None
        return self.kept


def test_a_working_policy_passes_through_unchanged():
    policy = build_policy("ada-snapkv")
    guarded, plain = guarded_select(policy, layer(), BUDGET), policy.select(layer(), BUDGET)
    assert torch.equal(guarded.indices, plain.indices) and torch.equal(guarded.counts, plain.counts)


@pytest.mark.parametrize(
    ("policy", "reason"),
    [(Raising(), "raised"), (NaNScoring(), "nan_scores")],
)
def test_a_failing_policy_becomes_a_counted_policy_fault(policy, reason):
    before = fallbacks(policy.name, reason)
    with pytest.raises(PolicyFault, match=reason) as caught:
        guarded_select(policy, layer(), BUDGET)
    assert isinstance(caught.value, RuntimeError)  # kept_selection.kept_or_newest answers with recent tokens
    assert fallbacks(policy.name, reason) == before + 1


def recent(counts: list[int], width: int | None = None) -> KeptTokens:
    width = width or max(counts)
    rows = [list(range(N - c, N)) + [-1] * (width - c) for c in counts]
    return KeptTokens(indices=torch.tensor(rows), counts=torch.tensor(counts))


@pytest.mark.parametrize(
    "kept",
    [
        recent([BUDGET, BUDGET - 1]),
        KeptTokens(torch.tensor([[0] * BUDGET, list(range(BUDGET))]), torch.tensor([BUDGET] * 2)),
        KeptTokens(torch.tensor([list(range(N, N + BUDGET))] * 2), torch.tensor([BUDGET] * 2)),
        KeptTokens(torch.tensor([list(range(BUDGET))] * 3), torch.tensor([BUDGET] * 3)),
    ],
    ids=["short-total", "repeated-index", "index-past-prompt", "three-heads"],
)
def test_kept_tokens_that_break_the_accounting_are_a_wrong_counts_fault(kept):
    before = fallbacks("returning", "wrong_counts")
    with pytest.raises(PolicyFault, match="wrong_counts"):
        guarded_select(Returning(kept), layer(), BUDGET)
    assert fallbacks("returning", "wrong_counts") == before + 1


def test_ragged_per_head_counts_with_the_right_total_are_accepted():
    kept = recent([BUDGET * 2, 0], width=BUDGET * 2)
    assert guarded_select(Returning(kept), layer(), BUDGET) is kept


def test_the_nan_check_leaves_the_policy_as_it_was():
    policy = build_policy("ada-snapkv")
    guarded_select(policy, layer(), BUDGET)
    assert "score" not in vars(policy.inner)


def test_injected_faults_hit_only_prompts_of_their_length(monkeypatch):
    monkeypatch.setenv(policy_guard.FAULT_INJECTION_ENV, '{"raise": 97, "wrong_counts": 98, "nan": 99}')
    policy_guard.injected_faults.cache_clear()
    try:
        policy = build_policy("snapkv")
        guarded_select(policy, layer(N), BUDGET)
        for n, reason in ((97, "raised"), (98, "wrong_counts"), (99, "nan_scores")):
            with pytest.raises(PolicyFault, match=reason):
                guarded_select(policy, layer(n), BUDGET)
    finally:
        monkeypatch.delenv(policy_guard.FAULT_INJECTION_ENV)
        policy_guard.injected_faults.cache_clear()


def test_an_unknown_injected_fault_is_refused_with_the_valid_ones(monkeypatch):
    monkeypatch.setenv(policy_guard.FAULT_INJECTION_ENV, '{"explode": 41}')
    policy_guard.injected_faults.cache_clear()
    try:
        with pytest.raises(ValueError, match="explode.*raise, wrong_counts, nan"):
            policy_guard.injected_faults()
    finally:
        monkeypatch.delenv(policy_guard.FAULT_INJECTION_ENV)
        policy_guard.injected_faults.cache_clear()
