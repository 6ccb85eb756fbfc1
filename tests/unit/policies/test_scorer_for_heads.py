"""A learned scorer on a tensor-parallel rank: each rank holds some of the model's KV heads and scores them
with its slice of the scorer (``scorer_for_heads``), which gives each of those heads the score the whole
scorer gives it; ``KVzap`` uses the slice where the process serves a rank's heads
(``served_scorer.serve_heads``); a scorer whose heads read each other's rows has no slice and is refused
on several ranks at start-up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from learned_scorers import random_scorer

from vllm_kvevict.policies import served_scorer
from vllm_kvevict.policies.base import LayerKV
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.policies.surrogate_scorer import SurrogateScorer, scorer_for_heads
from vllm_kvevict.vllm_adapter.learned_scorer import rank_heads, tensor_parallel_problem

LAYERS, HEADS, DIM = 3, 4, 16


def scorer_with_standardisation(kind: str, per_head: bool = True) -> SurrogateScorer:
    """A random scorer whose feature standardisation is not the identity (so a wrong slice shows)."""
    scorer = random_scorer(LAYERS, HEADS, DIM, kind, seed=2, per_head=per_head)
    g = torch.Generator().manual_seed(3)
    for layer in scorer.layers:
        layer["mean"] = torch.randn(layer["mean"].shape, generator=g)
        layer["scale"] = torch.rand(layer["scale"].shape, generator=g) + 0.5
        layer["b1"] = torch.randn(layer["b1"].shape, generator=g)
        if kind == "mlp":
            layer["b2"] = torch.randn(layer["b2"].shape, generator=g)
    return scorer


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize(("first", "count"), [(0, 1), (1, 2), (3, 1), (0, 4)])
def test_a_slice_scores_its_heads_as_the_whole_scorer_does(kind: str, first: int, count: int) -> None:
    scorer = scorer_with_standardisation(kind)
    sliced = scorer_for_heads(scorer, first, count)
    assert sliced.spec.num_kv_heads == count
    g = torch.Generator().manual_seed(4)
    keys, values = torch.randn(HEADS, 50, DIM, generator=g), torch.randn(HEADS, 50, DIM, generator=g)
    for layer in range(LAYERS):
        whole = scorer.layer_scores(layer, keys, values)[first : first + count]
        rank = sliced.layer_scores(layer, keys[first : first + count], values[first : first + count])
        torch.testing.assert_close(rank, whole)


def test_a_scorer_whose_heads_read_each_other_has_no_slice() -> None:
    with pytest.raises(ValueError, match="scores each head from every head's row"):
        scorer_for_heads(scorer_with_standardisation("mlp", per_head=False), 1, 1)
    with pytest.raises(ValueError, match=r"heads \[3, 5\)"):
        scorer_for_heads(scorer_with_standardisation("linear"), 3, 2)


@pytest.mark.parametrize(
    ("total", "local", "rank", "ranks", "expected"),
    [(3, 1, 2, 3, (2, 1)), (8, 2, 1, 4, (2, 2)), (2, 1, 3, 4, (1, 1)), (2, 1, 1, 4, (0, 1))],
)  # fmt: skip
def test_each_rank_holds_consecutive_heads_or_a_replica(total, local, rank, ranks, expected) -> None:
    assert rank_heads(total, local, rank, ranks) == expected


def test_kvzap_on_a_rank_scores_its_heads_with_the_slice(tmp_path) -> None:
    scorer = scorer_with_standardisation("linear")
    scorer.save(tmp_path)
    policy = build_policy("kvzap", scorer=str(tmp_path), window=4, sinks=1)
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(HEADS, 40, DIM, generator=g), torch.randn(HEADS, 40, DIM, generator=g)

    def layer_of(heads: slice) -> LayerKV:
        rows = {"keys": keys[heads], "values": values[heads], "queries": keys[heads, :0]}
        return LayerKV(**rows, layer_idx=1, num_layers=LAYERS)

    whole = policy.entry_scores(layer_of(slice(None)))
    try:
        served_scorer.serve_heads(2, 1, HEADS)
        rank = policy.entry_scores(layer_of(slice(2, 3)))
    finally:
        served_scorer.forget_served_model()
    torch.testing.assert_close(rank, whole[2:3])
    with pytest.raises(ValueError, match="1 KV heads"):  # no rank layout recorded: the shapes differ
        policy.learned_scorer(layer_of(slice(2, 3)))


def test_a_joint_scorer_is_refused_on_several_ranks_in_one_line(tmp_path) -> None:
    joint, alone = tmp_path / "joint", tmp_path / "alone"
    scorer_with_standardisation("mlp", per_head=False).save(joint)
    scorer_with_standardisation("mlp").save(alone)
    three = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=3))
    one = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
    learned = build_policy("kvzap", scorer=str(joint))
    error = tensor_parallel_problem("kvzap", learned, three)
    assert error is not None and "3 tensor-parallel ranks" in error and "--tensor-parallel-size 1" in error
    assert "\n" not in error
    assert tensor_parallel_problem("kvzap", learned, one) is None
    assert tensor_parallel_problem("kvzap", build_policy("kvzap", scorer=str(alone)), three) is None
