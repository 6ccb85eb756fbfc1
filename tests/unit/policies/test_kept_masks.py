"""Selection rules on hand-written scores."""

from __future__ import annotations

import torch

from vllm_kvevict.policies.kept_masks import (
    ada_allocation,
    ada_blend_allocation,
    blend_budgets,
    critical_selection,
    head_seed,
    robust_selection,
    safeguard_size,
    sample_per_head,
    top_k_mask,
    whole_unit_counts,
    whole_unit_mask,
)

INF = float("inf")


def kept(mask: torch.Tensor) -> list[list[int]]:
    return [row.nonzero().squeeze(1).tolist() for row in mask]


def test_top_k_breaks_ties_towards_the_lower_index() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    assert kept(top_k_mask(scores, 2)) == [[1, 2], [0, 1]]


def test_top_k_takes_ragged_counts_and_eligibility() -> None:
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0]])
    eligible = torch.tensor([[True, False, True, True], [True, True, True, True]])
    assert kept(top_k_mask(scores, torch.tensor([2, 3]), eligible)) == [[0, 2], [0, 1, 2]]
    # Never more than the eligible tokens.
    assert kept(top_k_mask(scores, 4, eligible)) == [[0, 2, 3], [0, 1, 2, 3]]


def test_top_k_ranks_nan_last() -> None:
    assert kept(top_k_mask(torch.tensor([[float("nan"), 0.0, 1.0]]), 2)) == [[1, 2]]


def test_safeguard_is_floor_of_alpha_budget_and_at_least_one() -> None:
    assert safeguard_size(10, 0.2) == 2
    assert safeguard_size(4, 0.2) == 1
    assert safeguard_size(10, 0.0) == 0


def test_ada_allocation_gives_spare_slots_to_the_best_scores_of_any_head() -> None:
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.0, 0.0], [0.1, 0.05, 0.0, 0.0, 0.0, 0.0]])
    # Budget 2 per head, alpha 0.5: each head keeps its top 1, the 2 spare slots go to 0.8 and 0.7.
    mask = ada_allocation(scores, budget=2, alpha=0.5)
    assert kept(mask) == [[0, 1, 2], [0]]
    # alpha 1: everything is safeguarded, the allocation is uniform.
    assert kept(ada_allocation(scores, budget=2, alpha=1.0)) == [[0, 1], [0, 1]]


def test_ada_allocation_keeps_always_kept_tokens_of_every_head() -> None:
    scores = torch.tensor([[0.9, 0.8, 0.7, INF], [0.1, 0.0, 0.0, INF]])
    mask = ada_allocation(scores, budget=2, alpha=0.2)
    # Guaranteed: top 1 of each head (the +inf token); spare 2 slots: 0.9 and 0.8 of head 0.
    assert kept(mask) == [[0, 1, 3], [3]]
    assert int(mask.sum()) == 4


def test_critical_selection_two_stages_by_hand() -> None:
    scores = torch.tensor([[0.5, 0.4, 0.3, 0.2, 0.1, INF]])
    norms = torch.tensor([[1.0, 1.0, 1.0, 10.0, 10.0, 1.0]])
    # Budget 4, ratio 0.5: stage 1 = 2 tokens counting the +inf one -> token 0 by attention;
    # stage 2: (s + eps) * norm -> tokens 3 (2.0) and 4 (1.0) beat 1 (0.4) and 2 (0.3).
    mask = critical_selection(scores, norms, torch.tensor([4]), 0.5, 1e-4)
    assert kept(mask) == [[0, 3, 4, 5]]


def test_critical_selection_ragged_budgets_and_first_stage_floor() -> None:
    scores = torch.tensor([[0.5, 0.4, 0.3, 0.2], [0.5, 0.4, 0.3, 0.2]])
    norms = torch.tensor([[1.0, 1.0, 1.0, 100.0], [1.0, 1.0, 1.0, 100.0]])
    # Head 0: budget 1, floor 1 -> the attention top; head 1: budget 2, floor 0 -> stage 1 = 1, stage 2 = 3.
    mask = critical_selection(scores, norms, torch.tensor([1, 2]), 0.5, 1e-4, first_stage_floor=1)
    assert kept(mask) == [[0], [0, 3]]
    # Ratio 0, no floor: everything by (s + eps) * norm -> token 3 (20.0) first, then token 0 (0.5).
    mask = critical_selection(scores, norms, torch.tensor([1, 2]), 0.0, 1e-4)
    assert kept(mask) == [[3], [0, 3]]


def test_head_seeds_differ_per_head_and_layer_and_repeat() -> None:
    seeds = {head_seed(7, layer, head) for layer in range(30) for head in range(8)}
    assert len(seeds) == 240
    assert head_seed(7, 3, 2) == head_seed(7, 3, 2)
    assert head_seed(7, 3, 2) != head_seed(8, 3, 2)


def test_sampling_is_deterministic_per_seed_and_different_per_head() -> None:
    weights = torch.ones(4, 200)
    eligible = torch.ones(4, 200, dtype=torch.bool)
    first = sample_per_head(weights, 20, eligible, seed=1, layer_idx=0)
    assert torch.equal(first, sample_per_head(weights, 20, eligible, seed=1, layer_idx=0))
    assert first.sum(dim=1).tolist() == [20, 20, 20, 20]
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first, sample_per_head(weights, 20, eligible, seed=2, layer_idx=0))
    assert not torch.equal(first, sample_per_head(weights, 20, eligible, seed=1, layer_idx=1))


def test_sampling_follows_the_weights_and_eligibility() -> None:
    weights = torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    eligible = torch.tensor([[True, True, True, True, False, True]])
    # Token 1 carries all eligible weight: it is drawn first; the zero-weight rest still fills k.
    for seed in range(5):
        mask = sample_per_head(weights, 1, eligible, seed=seed, layer_idx=0)
        assert kept(mask) == [[1]]
    mask = sample_per_head(weights, 3, eligible, seed=0, layer_idx=0)
    assert 1 in kept(mask)[0] and 4 not in kept(mask)[0] and int(mask.sum()) == 3


def test_robust_selection_keeps_volatile_tokens_then_high_means() -> None:
    mean = torch.tensor([[0.9, 0.1, 0.5, 0.4, 0.05]])
    std = torch.tensor([[0.0, 0.8, 0.1, 0.0, 0.2]])
    eligible = torch.ones(1, 5, dtype=torch.bool)
    # k = 3, std_ratio 1/3 -> 1 by std (token 1), 2 by mean among the rest (tokens 0 and 2).
    assert kept(robust_selection(mean, std, 3, 1 / 3, eligible)) == [[0, 1, 2]]
    # std_ratio 0: pure mean ranking.
    assert kept(robust_selection(mean, std, 3, 0.0, eligible)) == [[0, 2, 3]]


def test_blend_budgets_by_hand_round_to_the_layer_total() -> None:
    # 0.2 * (10, 50, 90) + 0.8 * 50 = (42, 50, 58): exact.
    assert blend_budgets(torch.tensor([10, 50, 90]), 50, 0.2).tolist() == [42, 50, 58]
    # 0.5 * (1, 1, 7) + 0.5 * 3 = (2, 2, 5): exact; 0.3 * (0, 4, 5) + 0.7 * 3 = (2.1, 3.3, 3.6) -> floors
    # (2, 3, 3) sum 8, one more token to the largest remainder (head 2).
    assert blend_budgets(torch.tensor([1, 1, 7]), 3, 0.5).tolist() == [2, 2, 5]
    assert blend_budgets(torch.tensor([0, 4, 5]), 3, 0.3).tolist() == [2, 3, 4]
    # alpha 0 is uniform, alpha 1 the adaptive allocation itself.
    assert blend_budgets(torch.tensor([0, 4, 5]), 3, 0.0).tolist() == [3, 3, 3]
    assert blend_budgets(torch.tensor([0, 4, 5]), 3, 1.0).tolist() == [0, 4, 5]


def test_ada_blend_keeps_every_head_near_the_uniform_budget() -> None:
    # Head 0's scores dominate: the pure allocation gives it all 8 slots of a budget of 4 per head.
    scores = torch.tensor(
        [[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0], [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]]
    )
    assert ada_allocation(scores, 4, 0.0).sum(dim=1).tolist() == [8, 0]
    # Blend with alpha 0.5: B_h = 0.5 * (8, 0) + 0.5 * 4 = (6, 2), each head its own top tokens.
    assert kept(ada_blend_allocation(scores, 4, 0.5)) == [[0, 1, 2, 3, 4, 5], [0, 1]]
    # Always-kept tokens stay kept in the starved head.
    scores[1, 7] = INF
    assert kept(ada_blend_allocation(scores, 4, 0.5)) == [[0, 1, 2, 3, 4, 5], [0, 7]]


def test_whole_unit_counts_keep_the_total_and_give_units_by_remainder() -> None:
    # 8 units of 4 tokens: floors 5 + 1 + 1 = 7; the largest remainder (head 1: 3) gets the last one
    assert whole_unit_counts([21, 7, 4], 4, [0, 0, 0], 32) == [20, 8, 4]
    assert whole_unit_counts([16, 8, 8], 8, [0, 0, 0], 32) == [16, 8, 8]  # already whole: unchanged
    # ties of remainder go to the lower head
    assert whole_unit_counts([6, 6, 12], 4, [0, 0, 0], 32) == [8, 4, 12]


def test_whole_unit_counts_respect_the_always_kept_floor_and_the_limit() -> None:
    # head 2 must keep 5 (2 units of 4): the surplus unit comes from the smallest remainder above its floor
    assert whole_unit_counts([14, 14, 4], 4, [0, 0, 5], 32) == [12, 12, 8]
    assert whole_unit_counts([31, 1, 0], 4, [0, 0, 0], 32) == [32, 0, 0]  # no head past the limit
    for bad in (([5, 4], 4, [0, 0], 16), ([4, 4], 4, [0, 0], 10)):
        try:
            whole_unit_counts(*bad)
        except ValueError as exc:
            assert "multiples of 4" in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")


def test_whole_unit_mask_keeps_each_heads_top_tokens() -> None:
    torch.manual_seed(0)
    scores = torch.rand(3, 32)
    scores[:, :2] = INF  # always kept
    keep = ada_allocation(scores, 8, 0.2)
    aligned = whole_unit_mask(scores, keep, 4)
    counts = aligned.sum(dim=1)
    assert int(counts.sum()) == 24 and bool((counts % 4 == 0).all()) and bool(aligned[:, :2].all())
    assert torch.equal(aligned, top_k_mask(scores, counts))
    assert (counts - keep.sum(dim=1)).abs().max() < 4  # moved by less than one unit per head
