"""Engines built from Python (``LLM(...)``) get the CLI's guard rails: EngineArgs.create_engine_config."""

from __future__ import annotations

import os

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_kvevict.vllm_adapter.engine_setup import GUARDED_MARK, apply_eviction_from_additional_config
from vllm_kvevict.vllm_adapter.request_validation import SERVER_CONFIG_ENV, VALIDATOR_FQCN


@pytest.fixture(autouse=True)
def restore_environment(monkeypatch):
    """The rails publish the server config and pin the V1 runner through os.environ; undo both."""
    for name in (SERVER_CONFIG_ENV, "VLLM_USE_V2_MODEL_RUNNER"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)


def engine_args(model_dir, **kwargs) -> EngineArgs:
    return EngineArgs(model=str(model_dir), dtype="float32", **kwargs)


def test_create_engine_config_applies_the_rails(model_dir):
    args = engine_args(model_dir, additional_config={"kv_eviction": {"method": "snapkv", "budget": 256}})
    config = args.create_engine_config()
    assert config.scheduler_config.enable_chunked_prefill is True  # evicted chunk by chunk
    assert config.cache_config.enable_prefix_caching is True  # evicting requests skip it themselves
    assert config.model_config.enforce_eager is False  # compiled: attention is a splitting op
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert config.additional_config["kv_eviction"]["method"] == "snapkv"
    assert VALIDATOR_FQCN in args.logits_processors
    assert '"method": "snapkv"' in os.environ[SERVER_CONFIG_ENV]


def test_a_decode_cap_keeps_prompts_whole(model_dir):
    args = engine_args(model_dir, additional_config={"kv_eviction": {"method": "roco", "budget": 256}})
    assert args.create_engine_config().scheduler_config.enable_chunked_prefill is False


def test_without_eviction_nothing_changes(model_dir):
    args = engine_args(model_dir)
    config = args.create_engine_config()
    assert config.cache_config.enable_prefix_caching is True
    assert not getattr(args, GUARDED_MARK, False)
    assert not args.logits_processors


def test_bad_method_is_a_value_error_naming_it_and_the_valid_ones(model_dir):
    args = engine_args(model_dir, additional_config={"kv_eviction": {"method": "snapkvv", "budget": 256}})
    with pytest.raises(ValueError, match=r"snapkvv.*ada-snapkv"):
        args.create_engine_config()


def test_missing_budget_is_refused(model_dir):
    args = engine_args(model_dir, additional_config={"kv_eviction": {"method": "snapkv"}})
    with pytest.raises(ValueError, match="budget"):
        args.create_engine_config()


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline-parallel-size 2"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
    ],
)
def test_unsupported_engine_features_are_refused(model_dir, setting, named):
    args = engine_args(model_dir, additional_config={"kv_eviction": {"method": "snapkv", "budget": 256}})
    for name, value in setting.items():
        setattr(args, name, value)
    with pytest.raises(ValueError, match=named) as raised:
        apply_eviction_from_additional_config(args)
    assert "vllm serve: error" not in str(raised.value)



def test_a_pooled_budget_keeps_prefix_caching_and_chunked_prefill(model_dir):
    pooled = {"method": "kvzap", "budget": 0.25, "params": {"budget_scope": "model"}}
    config = engine_args(model_dir, additional_config={"kv_eviction": pooled}).create_engine_config()
    assert config.scheduler_config.enable_chunked_prefill is True
    assert config.cache_config.enable_prefix_caching is True


@pytest.mark.parametrize(
    ("is_cuda", "setting", "named"),
    [
        (True, {}, "CPU backend only"),
        (False, {"tensor_parallel_size": 3}, "--tensor-parallel-size 3 with budget_scope 'model'"),
    ],
)
def test_a_pooled_budget_refuses_cuda_and_tensor_parallelism(model_dir, is_cuda, setting, named):
    from vllm_kvevict.vllm_adapter.engine_requirements import (
        UnsupportedEngineSetting,
        fit_engine_to_pooled_blocks,
    )

    args = engine_args(model_dir, **setting)
    with pytest.raises(UnsupportedEngineSetting, match=named):
        fit_engine_to_pooled_blocks(args, is_cuda=is_cuda)
