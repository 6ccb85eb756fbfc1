"""The accounting rule for a kept count set by the scores (an adaptive plan, KVzap's threshold): the plan's
bound is a ceiling, a layer's entries fit the blocks its own bound keeps, and the request's reported bound
(its largest layer's) frees a superset of the ceiling's leading blocks."""

from __future__ import annotations

import pytest

from vllm_kvevict.layout.accounting import (
    adaptive_kept_bound,
    cdiv,
    first_block_for_bound,
    layer_kept_bound,
    plan_request,
    with_kept_bound,
)
from vllm_kvevict.layout.shared_prefix import reads_prefix_cache, spare_blocks
from vllm_kvevict.policies.registry import build_policy

BS, HEADS, LAYERS, PROMPT = 16, 3, 4, 1000


def adaptive_plan(budget: int = 400):
    return plan_request(PROMPT, budget, BS, build_policy("kvzap", threshold=0.0), LAYERS)


def test_an_adaptive_plan_never_shares_prefix_blocks_and_takes_no_spares() -> None:
    plan = adaptive_plan()
    assert plan.adaptive and plan.compacts
    assert not reads_prefix_cache(plan) and spare_blocks(plan) == 0
    assert not plan_request(PROMPT, 400, BS, build_policy("kvzap"), LAYERS).adaptive


@pytest.mark.parametrize("kept", [1, 38, 39, 40, 600, 3 * 400])
def test_a_layer_fits_the_blocks_its_own_bound_keeps(kept: int) -> None:
    bound = layer_kept_bound(PROMPT, kept, HEADS, BS)
    assert (PROMPT - bound) % BS == 0 and HEADS * bound >= kept
    first = first_block_for_bound(PROMPT, bound, BS)
    # however the heads split the entries, they take at most kept // bs + H sub-blocks (one partial each),
    # and the blocks from ``first`` on hold that many (the rule's spare block)
    assert kept // BS + HEADS <= HEADS * (cdiv(PROMPT, BS) - first)


def test_the_reported_bound_is_the_largest_layers_and_frees_at_least_the_ceilings_blocks() -> None:
    plan = adaptive_plan()
    bound = adaptive_kept_bound(plan, [90, 300, 150, 12], HEADS)
    assert bound == layer_kept_bound(PROMPT, 300, HEADS, BS)
    reported = with_kept_bound(plan, bound)
    assert reported.blocks_to_free == first_block_for_bound(PROMPT, bound, BS) > plan.blocks_to_free
    assert max(reported.layer_budgets) <= bound
    assert adaptive_kept_bound(plan, [HEADS * 400] * LAYERS, HEADS) == plan.kept_bound  # at the ceiling


def test_a_bound_the_plan_cannot_take_is_refused() -> None:
    plan = adaptive_plan()
    with pytest.raises(ValueError, match="must be <= the ceiling"):
        with_kept_bound(plan, plan.kept_bound + BS)
    with pytest.raises(ValueError, match="a multiple of 16"):
        with_kept_bound(plan, plan.kept_bound - 1)
    fixed = plan_request(PROMPT, 400, BS, build_policy("kvzap"), LAYERS)
    with pytest.raises(ValueError, match="only an adaptive plan"):
        with_kept_bound(fixed, fixed.kept_bound)
