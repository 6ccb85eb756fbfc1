"""Eviction settings: validated once, errors name the bad value and the valid ones."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest

from vllm_kvevict.settings.additional_config import eviction_config_from_additional
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.parsers import EvictionConfigError, parse_budget
from vllm_kvevict.vllm_adapter.eviction_flags import add_eviction_args, eviction_config_from_args
from vllm_kvevict.vllm_adapter.request_validation import MIDDLEWARE_PATH, SERVER_CONFIG_ENV, VALIDATOR_FQCN

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_eviction_args(parser)
    return parser.parse_args(argv)


def test_budget_int_means_tokens_and_float_means_fraction():
    assert parse_budget("1024") == 1024
    assert parse_budget("0.25") == 0.25
    assert parse_budget(512) == 512


@pytest.mark.parametrize("bad", ["0", "-3", "1.0", "2.5", "abc", True])
def test_bad_budget_names_the_value(bad):
    with pytest.raises(EvictionConfigError, match=repr(bad).strip("'") if isinstance(bad, str) else "True"):
        parse_budget(bad)


def test_unknown_method_lists_valid_ones():
    with pytest.raises(EvictionConfigError, match=r"'bogus'.*ada-snapkv"):
        EvictionConfig(method="bogus", budget=256)


def test_unknown_parameter_is_rejected():
    with pytest.raises(EvictionConfigError, match="windw"):
        EvictionConfig(method="snapkv", budget=256, params={"windw": 16})


def test_flags_become_additional_config():
    args = parse(
        ["--kv-eviction", "ada-snapkv", "--kv-budget", "1024", "--kv-eviction-config", '{"window": 16}']
    )
    config = eviction_config_from_args(args, {})
    assert config == EvictionConfig(method="ada-snapkv", budget=1024, params={"window": 16})


def test_flags_override_additional_config_fallback():
    args = parse(["--kv-budget", "0.5"])
    additional = {"kv_eviction": {"method": "snapkv", "budget": 256}}
    # --kv-budget alone refines an additional_config setting.
    assert eviction_config_from_args(args, additional).budget == 0.5


def test_no_flags_no_eviction():
    assert eviction_config_from_args(parse([]), {}) is None
    assert eviction_config_from_additional({}) is None
    assert eviction_config_from_additional({"kv_eviction": {}}) is None


def test_budget_without_method_is_an_error():
    with pytest.raises(EvictionConfigError, match="need --kv-eviction"):
        eviction_config_from_args(parse(["--kv-budget", "512"]), {})


def test_method_without_budget_is_an_error():
    with pytest.raises(EvictionConfigError, match="needs --kv-budget"):
        eviction_config_from_args(parse(["--kv-eviction", "snapkv"]), {})


def test_unknown_key_in_additional_config():
    with pytest.raises(EvictionConfigError, match="budgett"):
        eviction_config_from_additional({"kv_eviction": {"method": "snapkv", "budgett": 3}})


def test_argparse_rejects_unknown_method_with_choices():
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_eviction_args(parser)
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'bogus'"):
        parser.parse_args(["--kv-eviction", "bogus"])


def test_config_round_trips_through_dict():
    config = EvictionConfig(method="nacl", budget=0.2, params={"seed": 7})
    assert EvictionConfig.from_dict(config.to_dict()) == config


def test_guard_rails_keep_prefix_caching_and_chunked_prefill(monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.vllm_adapter.engine_setup import apply_eviction_to_engine_args

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setenv(SERVER_CONFIG_ENV, "")  # restored after the test
    # The real call turns on multi-process Prometheus for this whole pytest process; record it instead.
    multiprocess_calls = []
    monkeypatch.setattr(
        "vllm_kvevict.vllm_adapter.engine_setup.ensure_multiprocess_collection",
        lambda: multiprocess_calls.append(True),
    )
    engine_args = EngineArgs(model="unused", enable_prefix_caching=True, enable_chunked_prefill=True)
    args = parse(["--kv-eviction", "snapkv", "--kv-budget", "256"])
    apply_eviction_to_engine_args(args, engine_args)
    assert engine_args.additional_config["kv_eviction"] == {
        "method": "snapkv",
        "budget": 256,
        "params": {},
        "prefill": "whole",
        "chunk_budget": 1.5,
        "between": "blend",
        "between_share": 0.5,
        "between_span": None,
        "between_scorer": "keydiff",
        "question_echo": 32,
        "echo_between_chunks": False,
        "min_freed_share": 0.2,
    }
    assert engine_args.enable_prefix_caching is True  # evicting requests skip it themselves
    assert engine_args.enable_chunked_prefill is True  # prompts are evicted once, after their last chunk
    assert engine_args.enforce_eager is False  # compiled: attention is a splitting op

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert multiprocess_calls == [True]
    # Per-request vllm_xargs are validated by the API server against the server's setting.
    assert engine_args.logits_processors == [VALIDATOR_FQCN]
    assert args.middleware == [MIDDLEWARE_PATH]
    assert json.loads(os.environ[SERVER_CONFIG_ENV])["method"] == "snapkv"


def test_no_eviction_leaves_engine_args_alone():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.vllm_adapter.engine_setup import apply_eviction_to_engine_args

    engine_args = EngineArgs(model="unused", enable_prefix_caching=True)
    apply_eviction_to_engine_args(parse([]), engine_args)
    assert engine_args.enable_prefix_caching is True
    assert "kv_eviction" not in (engine_args.additional_config or {})


def test_bad_setting_exits_with_one_line():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.vllm_adapter.engine_setup import apply_eviction_to_engine_args

    engine_args = EngineArgs(model="unused", additional_config={"kv_eviction": {"method": "x", "budget": 1}})
    with pytest.raises(SystemExit, match=r"^vllm serve: error: kv_eviction.method='x' is not a known method"):
        apply_eviction_to_engine_args(parse([]), engine_args)


def test_cuda_selects_the_evicting_custom_backend():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.vllm_adapter.engine_requirements import select_cuda_backend

    engine_args = EngineArgs(model="unused")
    select_cuda_backend(engine_args, is_cuda=True)
    assert engine_args.attention_backend == "CUSTOM"
    cpu_args = EngineArgs(model="unused")
    select_cuda_backend(cpu_args, is_cuda=False)
    assert cpu_args.attention_backend is None


def test_cuda_refuses_a_backend_that_cannot_evict():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.vllm_adapter.engine_requirements import select_cuda_backend

    engine_args = EngineArgs(model="unused", attention_backend="FLASH_ATTN")
    with pytest.raises(SystemExit, match="FLASH_ATTN cannot evict"):
        select_cuda_backend(engine_args, is_cuda=True)


# ----- preset files -----------------------------------------------------------------------------------------
def test_a_preset_file_gives_method_and_parameters():
    import yaml

    path = CONFIGS / "kvpress-snapkv.yaml"
    args = parse(["--kv-eviction-config", str(path), "--kv-budget", "512"])
    config = eviction_config_from_args(args, {})
    preset = yaml.safe_load(path.read_text())
    assert preset["method"] == "snapkv" and preset["params"]["window"] == 64
    assert config == EvictionConfig(method="snapkv", budget=512, params=preset["params"])


def test_a_preset_may_repeat_its_method_but_not_contradict_it():
    preset = str(CONFIGS / "ada-snapkv.yaml")
    same = parse(["--kv-eviction", "ada-snapkv", "--kv-eviction-config", preset, "--kv-budget", "256"])
    assert eviction_config_from_args(same, {}).method == "ada-snapkv"
    other = parse(["--kv-eviction", "snapkv", "--kv-eviction-config", preset, "--kv-budget", "256"])
    with pytest.raises(EvictionConfigError, match="--kv-eviction snapkv contradicts the preset's method"):
        eviction_config_from_args(other, {})


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "no such file"),
        ("method: [unclosed", "is not valid YAML"),
        ("method: bogus\nparams: {}", "unknown eviction method 'bogus'; valid methods: snapkv"),
        ("method: snapkv\nparams: {windw: 3}", "unknown parameter(s) windw for method 'snapkv'"),
        ("- just a list", "a preset is a mapping"),
    ],
)
def test_a_bad_preset_file_is_one_line_naming_the_file_and_the_problem(tmp_path, content, problem):
    path = tmp_path / "preset.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(argparse.ArgumentError) as raised:
        parse(["--kv-eviction-config", str(path)])
    message = str(raised.value)
    assert f"--kv-eviction-config {path}: " in message and problem in message
    assert "\n" not in message


def test_json_parameters_still_work_beside_preset_files():
    assert parse(["--kv-eviction-config", '{"window": 16}']).kv_eviction_config == {"window": 16}


def test_pipeline_parallelism_is_refused_with_one_line(monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.vllm_adapter.engine_setup import apply_eviction_to_engine_args

    monkeypatch.setenv(SERVER_CONFIG_ENV, "")
    engine_args = EngineArgs(model="unused", pipeline_parallel_size=2)
    with pytest.raises(SystemExit, match=r"^vllm serve: error: --pipeline-parallel-size 2 is not supported"):
        apply_eviction_to_engine_args(parse(["--kv-eviction", "snapkv", "--kv-budget", "256"]), engine_args)


def test_compiled_model_keeps_attention_out_of_cuda_graphs():
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.vllm_adapter.engine_requirements import keep_attention_out_of_graphs

    for given in (
        None,
        CUDAGraphMode.FULL_AND_PIECEWISE,
        CUDAGraphMode.FULL_DECODE_ONLY,
        CUDAGraphMode.PIECEWISE,
    ):
        engine_args = EngineArgs(model="unused", compilation_config=CompilationConfig(cudagraph_mode=given))
        keep_attention_out_of_graphs(engine_args, is_cuda=True)
        assert engine_args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    cpu = EngineArgs(model="unused")
    keep_attention_out_of_graphs(cpu, is_cuda=False)
    assert cpu.compilation_config.cudagraph_mode is None and not cpu.enforce_eager
    no_split = EngineArgs(model="unused", compilation_config={"splitting_ops": []})
    with pytest.raises(SystemExit, match=r"splitting_ops=\[\] compiles attention"):
        keep_attention_out_of_graphs(no_split, is_cuda=False)


def test_between_share_and_span_come_with_the_prefill_schedule_and_bad_ones_are_named():
    from vllm_kvevict.policies.between_chunks import BetweenRule

    # --kv-eviction-config puts them among the params; additional_config may carry them at the top level.
    raw = {"method": "ada-snapkv", "budget": 0.25,
           "params": {"prefill": "chunked", "between_share": 0.25, "between_span": 16}}
    config = EvictionConfig.from_dict(raw)
    assert config.params == {}
    assert config.between_rule == BetweenRule("blend", share=0.25, span_after=16)
    assert EvictionConfig.from_dict(config.to_dict()) == config
    assert "between=blend share=0.25 scorer=keydiff span=16" in config.describe()
    assert "between=blend share=0.5 scorer=keydiff span=16-from-512-else-8" in EvictionConfig.from_dict(
        {"method": "snapkv", "budget": 256, "prefill": "chunked"}
    ).describe()
    by_norm = EvictionConfig.from_dict(
        {"method": "snapkv", "budget": 256, "params": {"prefill": "chunked", "between_scorer": "knorm"}}
    )
    assert by_norm.between_rule == BetweenRule("blend", scorer="knorm")
    assert EvictionConfig.from_dict(by_norm.to_dict()) == by_norm
    assert "between=blend share=0.5 scorer=knorm" in by_norm.describe()
    bad = (("between", "question", "window, keydiff, knorm, blend"),
           ("between_share", 2, "a number in [0.0, 1.0]"), ("between_span", 1.5, "an int >= 0"),
           ("between_scorer", "norm", "keydiff, knorm"))
    for key, value, valid in bad:
        message = rf"kv_eviction\.{key}={value!r} is not valid.*{re.escape(valid)}"
        with pytest.raises(EvictionConfigError, match=message):
            EvictionConfig.from_dict({"method": "snapkv", "budget": 256, key: value})


def test_a_trailing_window_comes_with_the_prefill_schedule_and_a_bad_one_is_named():
    raw = {"method": "ada-snapkv", "budget": 0.1, "params": {"prefill": "chunked", "trailing_window": 256}}
    config = EvictionConfig.from_dict(raw)
    assert config.params == {} and config.trailing_window == 256
    assert EvictionConfig.from_dict(config.to_dict()) == config
    assert "prefill=chunked trailing_window=256 (FastKVzip's" in config.describe()
    assert "trailing_window" not in EvictionConfig.from_dict({**raw, "params": {}}).to_dict()
    for value in (-1, 1.5, True, "wide"):
        message = rf"kv_eviction\.trailing_window={value!r} is not valid; use an integer >= 0"
        with pytest.raises(EvictionConfigError, match=message):
            EvictionConfig.from_dict({"method": "snapkv", "budget": 256, "trailing_window": value})
