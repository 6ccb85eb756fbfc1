"""One budget rule, read by one parser (``config.parse_budget``) at every entry point: ``--kv-budget``,
``--kv-decode-budget``, ``additional_config`` / presets and ``vllm_xargs`` (``kv_budget``,
``kv_decode_budget``)."""

from __future__ import annotations

import argparse

import pytest

from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.parsers import EvictionConfigError, budget_rule, parse_budget
from vllm_kvevict.settings.request_override import parse_override
from vllm_kvevict.vllm_adapter.eviction_flags import add_eviction_args

SERVER = EvictionConfig("snapkv", 512, {"window": 4})
CAPPED = EvictionConfig.from_dict({"method": "h2o", "budget": 512})


def flag(name: str, text: str) -> int | float:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_eviction_args(parser)
    return getattr(parser.parse_args([name, text]), name.removeprefix("--").replace("-", "_"))


def config_budget(raw: object) -> int | float:
    return EvictionConfig.from_dict({"method": "snapkv", "budget": raw}).budget


def config_decode_budget(raw: object) -> int | float:
    decode = {"method": "h2o", "budget": raw}
    config = EvictionConfig.from_dict({"method": "snapkv", "budget": 512, "decode": decode})
    assert config.decode is not None
    return config.decode.budget


def xargs_budget(raw: object) -> int | float | None:
    override = parse_override({"kv_budget": raw}, SERVER)
    assert override is not None
    return override.budget


def xargs_decode_budget(raw: object) -> int | float | None:
    override = parse_override({"kv_decode_budget": raw}, CAPPED)
    assert override is not None
    return override.decode_budget


JSON_ENTRY_POINTS = {
    "kv_eviction.budget": config_budget,
    "kv_eviction.decode.budget": config_decode_budget,
    "vllm_xargs.kv_budget": xargs_budget,
    "vllm_xargs.kv_decode_budget": xargs_decode_budget,
}
FLAGS = ("--kv-budget", "--kv-decode-budget")


@pytest.mark.parametrize("value", [1024, 0.25])
def test_every_entry_point_reads_a_valid_budget_as_the_same_number(value):
    assert [read(value) for read in JSON_ENTRY_POINTS.values()] == [value] * 4
    assert [flag(name, str(value)) for name in FLAGS] == [value] * 2


@pytest.mark.parametrize("value", [0, -3, 1.0, 2.5])
def test_every_entry_point_refuses_an_out_of_range_budget_naming_it_and_the_valid_ones(value):
    for field, read in JSON_ENTRY_POINTS.items():
        with pytest.raises(EvictionConfigError) as raised:
            read(value)
        assert f"{field}={value!r}" in str(raised.value) and budget_rule() in str(raised.value)
    for name in FLAGS:
        with pytest.raises(argparse.ArgumentError) as raised:
            flag(name, str(value))
        assert f"{name}={str(value)!r}" in str(raised.value) and budget_rule() in str(raised.value)


@pytest.mark.parametrize("read", JSON_ENTRY_POINTS.values(), ids=JSON_ENTRY_POINTS)
def test_a_bool_is_never_a_budget(read):
    with pytest.raises(EvictionConfigError, match="=True is a bool, not a number"):
        read(True)


def test_text_is_read_as_a_number_but_a_vllm_xargs_string_is_refused():
    assert config_budget("0.25") == 0.25 and config_decode_budget(" 2048 ") == 2048
    with pytest.raises(EvictionConfigError, match=r"vllm_xargs.kv_budget='0.25' is a string, not a number"):
        xargs_budget("0.25")
    with pytest.raises(EvictionConfigError, match=r"kv_eviction.budget='lots' is not a number; valid: an"):
        config_budget("lots")


def test_an_integer_below_the_methods_minimum_names_who_keeps_it():
    with pytest.raises(EvictionConfigError) as raised:
        parse_budget(16, "vllm_xargs.kv_budget", minimum=32, minimum_kept_by="tokens snapkv always keeps")
    assert str(raised.value) == (
        "vllm_xargs.kv_budget=16 is below the 32 tokens snapkv always keeps; valid: an integer >= 32 (kept "
        "tokens per KV head) or a float in (0, 1) (kept fraction of the prompt)"
    )
    assert parse_budget(0.01, minimum=32) == 0.01  # a fraction is raised to the minimum per prompt instead
