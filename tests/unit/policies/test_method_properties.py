"""A method's properties come from the registry: the o_proj weights it reads and the decode cap it implies."""

from __future__ import annotations

import dataclasses

import pytest
from policy_layers import random_layer

from vllm_kvevict.policies.registry import (
    available_methods,
    build_policy,
    decode_method_names,
    method_implies_decode_cap,
    method_names,
    method_needs_o_proj,
)


@pytest.mark.parametrize("name", method_names())
def test_a_method_needs_o_proj_exactly_when_it_cannot_select_without_it(name: str) -> None:
    policy = build_policy(name)
    n = 200
    layer = dataclasses.replace(random_layer(n=n, w=policy.query_window(n)), o_proj=None)
    budget = max(64, policy.min_budget)
    if method_needs_o_proj(name):
        with pytest.raises(ValueError, match="o_proj"):
            policy.select(layer, budget)
    else:
        assert policy.select(layer, budget).total == layer.num_kv_heads * budget


def test_the_critical_methods_are_the_ones_that_need_o_proj() -> None:
    assert [name for name in method_names() if method_needs_o_proj(name)] == [
        "critical-snapkv",
        "critical-ada-snapkv",
    ]


def test_the_paper_methods_defined_at_decode_time_imply_a_decode_cap() -> None:
    implied = [name for name in method_names() if method_implies_decode_cap(name)]
    assert sorted(implied) == ["h2o", "roco", "streamingllm"]
    assert set(implied) <= set(decode_method_names())  # the cap runs the method's decode form


def test_an_unknown_name_has_neither_property() -> None:
    assert not method_needs_o_proj("bogus") and not method_implies_decode_cap("bogus")
    assert not method_implies_decode_cap(["not", "a", "name"])  # type: ignore[arg-type]


def test_method_info_carries_the_same_properties() -> None:
    for info in available_methods():
        assert (info.needs_o_proj, info.implies_decode_cap) == (
            method_needs_o_proj(info.name),
            method_implies_decode_cap(info.name),
        )


def test_the_methods_that_keep_a_context_keep_whole_blocks_in_every_head() -> None:
    """``kept_context_form``: uniform top-k methods as they are, Ada-KV with head budgets in whole blocks;
    per-layer budgets (PyramidKV), CriticalKV's and NaCl's selections and decode-time methods keep none."""
    unit, n = 16, 256
    keeping = []
    for name in method_names():
        if name in ("kvzap", "ada-kvzap"):
            continue  # need a scorer directory: tests/unit/settings/test_learned_requests.py
        form = build_policy(name).kept_context_form(unit)
        if form is None:
            continue
        keeping.append(name)
        layer = random_layer(kv_heads=3, n=n, w=form.query_window(n))
        kept = form.select(layer, 64)
        assert kept.total == 3 * 64 and bool((kept.counts % unit == 0).all()), name
        assert form.name == name
    assert {"snapkv", "ada-snapkv", "ada-expected-attention", "knorm", "streamingllm"} <= set(keeping)
    assert not {"pyramidkv", "ada-pyramidkv", "critical-snapkv", "critical-ada-snapkv", "nacl"} & set(keeping)
    assert build_policy("ada-snapkv").kept_context_form(1).head_unit == 1  # any unit: only whole units
