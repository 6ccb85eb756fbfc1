"""The decode-time cap settings: flags, implied caps of the paper methods, one clear error per bad value."""

from __future__ import annotations

import argparse

import pytest

from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.parsers import EvictionConfigError
from vllm_kvevict.vllm_adapter.eviction_flags import add_eviction_args, eviction_config_from_args


def config_of(argv: list[str]) -> EvictionConfig | None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_eviction_args(parser)
    return eviction_config_from_args(parser.parse_args(argv), None)


def test_a_decode_method_composes_with_a_prefill_method():
    config = config_of(
        [
            "--kv-eviction",
            "ada-snapkv",
            "--kv-budget",
            "1024",
            "--kv-decode-eviction",
            "roco",
            "--kv-decode-budget",
            "2048",
        ]
    )
    assert config.method == "ada-snapkv" and config.budget == 1024
    assert config.decode.method == "roco" and config.decode.budget == 2048 and config.decode.interval is None


@pytest.mark.parametrize("method", ["roco", "h2o", "streamingllm"])
def test_a_decode_time_paper_method_alone_caps_decoding_at_its_budget(method):
    config = config_of(["--kv-eviction", method, "--kv-budget", "512"])
    assert config.decode.method == method and config.decode.budget == 512


def test_a_prefill_only_method_keeps_every_generated_token():
    assert config_of(["--kv-eviction", "snapkv", "--kv-budget", "512"]).decode is None


def test_decode_none_turns_the_implied_cap_off_and_survives_the_round_trip():
    config = config_of(["--kv-eviction", "roco", "--kv-budget", "512", "--kv-decode-eviction", "none"])
    assert config.decode is None
    assert EvictionConfig.from_dict(config.to_dict()).decode is None


def test_an_interval_tunes_the_implied_cap():
    config = config_of(["--kv-eviction", "h2o", "--kv-budget", "512", "--kv-decode-interval", "64"])
    assert (config.decode.method, config.decode.budget, config.decode.interval) == ("h2o", 512, 64)


def test_the_config_round_trips_through_its_dict():
    config = config_of(
        [
            "--kv-eviction",
            "snapkv",
            "--kv-budget",
            "256",
            "--kv-decode-eviction",
            "snapkv",
            "--kv-decode-budget",
            "0.5",
            "--kv-decode-allocation",
            "ada",
            "--kv-decode-config",
            '{"window": 16}',
        ]
    )
    assert EvictionConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--kv-eviction", "snapkv", "--kv-budget", "512", "--kv-decode-eviction", "roco"],
            "--kv-decode-budget",
        ),
        (
            [
                "--kv-eviction",
                "snapkv",
                "--kv-budget",
                "512",
                "--kv-decode-eviction",
                "snapkv",
                "--kv-decode-budget",
                "8",
            ],
            "budget=8 .* >= 32",
        ),
        (["--kv-eviction", "roco", "--kv-budget", "512", "--kv-decode-interval", "512"], "interval=512"),
        (
            ["--kv-eviction", "snapkv", "--kv-budget", "512", "--kv-decode-budget", "64"],
            "--kv-decode-eviction",
        ),
        (["--kv-decode-eviction", "roco", "--kv-decode-budget", "512"], "--kv-eviction METHOD"),
        (
            [
                "--kv-eviction",
                "roco",
                "--kv-budget",
                "512",
                "--kv-decode-eviction",
                "none",
                "--kv-decode-budget",
                "64",
            ],
            "none with --kv-decode-budget",
        ),
    ],
)
def test_a_bad_combination_is_one_line_naming_it(argv, message):
    with pytest.raises(EvictionConfigError, match=message) as caught:
        config_of(argv)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-decode-eviction", "bogus"], "'bogus'.*roco.*none"),
        (["--kv-decode-budget", "0"], "--kv-decode-budget='0'"),
        (["--kv-decode-interval", "x"], "--kv-decode-interval='x'"),
        (["--kv-decode-allocation", "fair"], "'fair'.*uniform"),
    ],
)
def test_a_bad_flag_value_names_it_and_the_valid_ones(argv, message):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_eviction_args(parser)
    with pytest.raises(argparse.ArgumentError, match=message):
        parser.parse_args(argv)


def test_a_dotted_additional_config_reaches_the_same_setting():
    raw = {"method": "snapkv", "budget": 512, "decode": {"method": "h2o", "budget": "1024", "interval": "32"}}
    config = EvictionConfig.from_dict(raw)
    assert (config.decode.method, config.decode.budget, config.decode.interval) == ("h2o", 1024, 32)


def test_an_unknown_decode_key_is_named():
    with pytest.raises(EvictionConfigError, match="'cap'"):
        EvictionConfig.from_dict({"method": "snapkv", "budget": 512, "decode": {"cap": 5}})


def test_a_per_request_decode_budget_needs_a_decode_method_on_the_server():
    from vllm_kvevict.settings.request_override import RequestOverride, parse_override

    capped = EvictionConfig.from_dict({"method": "h2o", "budget": 512})
    assert parse_override({"kv_decode_budget": 1024}, capped) == RequestOverride("h2o", 512, 1024)
    with pytest.raises(EvictionConfigError, match="kv_decode_budget=8 is below the 32"):
        parse_override({"kv_decode_budget": 8}, capped)
    with pytest.raises(EvictionConfigError, match="runs no decode-time eviction method"):
        parse_override({"kv_decode_budget": 1024}, EvictionConfig("snapkv", 512))
    with pytest.raises(EvictionConfigError, match="kv_decode_budget=1024 with kv_eviction='none'"):
        parse_override({"kv_eviction": "none", "kv_decode_budget": 1024}, capped)
