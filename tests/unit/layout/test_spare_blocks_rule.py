"""The spare-block rule (``layout/shared_prefix.py``) both sides apply: how many spare blocks a compacting
request may be given, how the worker reads them from its row, and how they change what is freed, where the
kept entries start and what is published."""

from __future__ import annotations

import pytest

from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.layout.shared_prefix import (
    first_kept_block,
    freed_range,
    publishable_tokens,
    spare_blocks,
    spare_blocks_seen,
    spare_columns_for,
)
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.request_settings import RequestSettings

BS = 32


def planner(budget: int | float, method: str = "ada-snapkv", **extra):
    config = EvictionConfig.from_dict({"method": method, "budget": budget, "prefill": "whole", **extra})
    return RequestSettings(config, BS, 30).plan_for


@pytest.mark.parametrize(("budget", "private"), [(0.25, 1000), (0.25, 456), (256, 3000), (0.1, 7001)])
def test_spares_hold_exactly_the_blocks_compacting_in_place_keeps(budget, private):
    plan = planner(budget)(private)
    k = spare_blocks(plan)
    assert plan.compacts and k == cdiv(private, BS) - plan.blocks_to_free == plan.blocks_held(0)
    shared = 5 * BS
    n = 5 + cdiv(private, BS)
    # Before the prompt is processed nothing is freed; after it every private prompt block is.
    assert freed_range(plan, shared, shared + private - 1, k) == (5, 5)
    assert freed_range(plan, shared, shared + private, k) == (5, n)
    assert first_kept_block(plan, shared, shared + private, k) == n
    assert first_kept_block(plan, shared, shared + private) == 5 + plan.blocks_to_free  # in place
    assert publishable_tokens(plan, shared, k) == shared + private
    assert publishable_tokens(plan, shared) == shared + plan.blocks_to_free * BS


def test_no_spares_for_a_plan_kept_whole_or_rewritten_over_time():
    assert spare_blocks(planner(0.25)(40)) == 0  # within budget: kept whole
    assert spare_blocks(planner(256, method="roco")(4000)) == 0  # a decode-time cap rewrites its blocks
    chunked = EvictionConfig.from_dict({"method": "snapkv", "budget": 256, "prefill": "chunked"})
    assert spare_blocks(RequestSettings(chunked, BS, 30).plan_for(4000)) == 0


def test_the_worker_reads_the_spares_from_the_row_and_refuses_any_other_surplus():
    plan = planner(0.25)(1000)
    k, n = spare_blocks(plan), cdiv(1000, BS)
    assert spare_blocks_seen(plan, n, 1000, 64) == 0  # the scheduler gave none: in place
    assert spare_blocks_seen(plan, n + k, 1000, 64) == k
    with pytest.raises(RuntimeError, match="disagree"):
        spare_blocks_seen(plan, n + k - 1, 1000, 64)
    with pytest.raises(RuntimeError, match="disagree"):
        spare_blocks_seen(plan, n + k, 1000, k - 1)  # more than the row's spare columns


def test_spare_columns_cover_every_private_part_up_to_the_model_length():
    plan_for = planner(0.25)
    columns = spare_columns_for(plan_for, 4096)
    assert columns == max(spare_blocks(plan_for(p)) for p in range(1, 4097))
    assert spare_columns_for(plan_for, 0) == 0
