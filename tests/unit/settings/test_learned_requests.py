"""Per request with a learned method: HTTP 400 naming calibrate where the served model has no scorer, kept
contexts with Ada-KV's head budgets in whole blocks (the served default ada-snapkv keeps one as ada-kvzap
where the model has a scorer), and chunk by chunk only with a scorer whose heads score alone."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from learned_scorers import random_scorer
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from vllm_kvevict.policies import served_scorer
from vllm_kvevict.settings.config import EvictionConfig, EvictionConfigError
from vllm_kvevict.settings.request_override import parse_override
from vllm_kvevict.settings.request_settings import RequestSettings
from vllm_kvevict.vllm_adapter.request_validation import SERVER_CONFIG_ENV, validate_request_args

BS, LAYERS, HEADS, DIM = 16, 4, 2, 16
DEFAULT_SERVER = EvictionConfig("ada-snapkv", 64, {"window": 8})
UNKNOWN_MODEL = SimpleNamespace(
    architectures=["NoScorerForCausalLM"],
    num_attention_heads=4,
    num_key_value_heads=HEADS,
    num_hidden_layers=LAYERS,
    hidden_size=64,
    vocab_size=10,
)


@pytest.fixture
def scorer_dir(tmp_path: Path) -> str:
    random_scorer(LAYERS, HEADS, DIM).save(tmp_path / "per-head")
    return str(tmp_path / "per-head")


@pytest.fixture
def served_without_scorer():
    """This process serves a model no scorer ships for (what the plugin's start-up check records)."""
    assert served_scorer.serve_model(UNKNOWN_MODEL, "no-scorer-model") is not None
    yield
    served_scorer.forget_served_model()


def test_a_learned_method_on_a_server_whose_model_has_no_scorer_is_a_400_naming_calibrate(
    served_without_scorer, monkeypatch
):
    for method in ("kvzap", "ada-kvzap"):
        with pytest.raises(EvictionConfigError) as raised:
            parse_override({"kv_eviction": method}, DEFAULT_SERVER)
        message = str(raised.value)
        assert message.startswith(f"vllm_xargs.kv_eviction={method!r}: {method} needs a learned scorer: ")
        assert "no learned scorer ships for no-scorer-model" in message
        assert "`vllm-kvevict calibrate MODEL --out DIR`" in message and "\n" not in message
    # the API server's validator: the 400 vLLM answers with
    monkeypatch.setenv(SERVER_CONFIG_ENV, json.dumps(DEFAULT_SERVER.to_dict(), sort_keys=True))
    with pytest.raises(VLLMValidationError, match="vllm-kvevict calibrate"):
        validate_request_args(SamplingParams(extra_args={"kv_eviction": "kvzap"}))
    validate_request_args(SamplingParams(extra_args={"kv_eviction": "snapkv"}))  # the others still run


def test_with_a_scorer_a_learned_method_runs_per_request(scorer_dir):
    override = parse_override({"kv_eviction": "kvzap", "kv_budget": 48}, DEFAULT_SERVER)
    assert override is not None and override.method == "kvzap"  # the directory-less default (test scorer)
    server = EvictionConfig("ada-kvzap", 64, {"scorer": scorer_dir})
    assert parse_override({"kv_budget": 0.2}, server).method == "ada-kvzap"


@pytest.fixture
def served_with_scorer(scorer_dir):
    """This process serves a model whose scorer is ``scorer_dir`` (its fingerprint matches)."""
    model = SimpleNamespace(
        architectures=["random"],
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        num_hidden_layers=LAYERS,
        hidden_size=HEADS * DIM,
        head_dim=DIM,
        vocab_size=0,
    )
    assert served_scorer.serve_model(model, "random-model", scorer_dir) is None
    yield scorer_dir
    served_scorer.forget_served_model()


def test_an_ada_kvzap_request_keeping_a_context_keeps_head_budgets_in_whole_blocks(scorer_dir):
    server = EvictionConfig("ada-kvzap", 64, {"scorer": scorer_dir, "window": 16, "alpha": 0.3})
    settings = RequestSettings(server, BS, LAYERS)
    keep = settings.resolve({"kv_context": "keep"})
    assert keep.method == "ada-kvzap" and keep.keeps_context and keep.policy.name == "ada-kvzap"
    assert keep.policy.head_unit == BS and keep.policy.alpha == 0.3 and keep.policy.inner.window == 16
    assert len(set(keep.plan_for(1000).layer_budgets)) == 1  # one budget per layer, split among the heads
    uniform = settings.resolve({"kv_eviction": "kvzap", "kv_context": "keep"})
    assert uniform.method == "kvzap" and uniform.identity != keep.identity  # other kept sets, other entries
    assert settings.resolve({"kv_budget": 0.5}).policy.head_unit == 1  # without keep: Ada-KV as always


def test_the_served_default_keeps_a_context_as_ada_kvzap_where_the_model_has_a_scorer(served_with_scorer):
    settings = RequestSettings(DEFAULT_SERVER, BS, LAYERS)
    keep = settings.resolve({"kv_context": "keep"})
    assert keep.method == "ada-kvzap" and keep.policy.head_unit == BS
    assert keep.policy.inner.window == 8  # the server's window, which ada-kvzap accepts too
    asked = settings.resolve({"kv_eviction": "ada-kvzap", "kv_context": "keep"})
    assert asked.method == "ada-kvzap" and asked.policy.head_unit == BS
    assert settings.resolve({"kv_budget": 0.5}).method == "ada-snapkv"  # without keep: the default


def test_without_a_scorer_the_served_default_keeps_a_context_as_itself(served_without_scorer):
    keep = RequestSettings(DEFAULT_SERVER, BS, LAYERS).resolve({"kv_context": "keep"})
    assert keep.method == "ada-snapkv" and keep.policy.head_unit == BS


def test_a_method_with_budgets_per_layer_keeping_a_context_is_refused_naming_the_ones_that_can():
    with pytest.raises(EvictionConfigError) as raised:
        parse_override({"kv_context": "keep", "kv_eviction": "pyramidkv"}, DEFAULT_SERVER)
    message = str(raised.value)
    assert "kv_eviction='pyramidkv': a kept context needs a method whose heads keep whole blocks" in message
    valid = message.split("valid: ")[1].split(", ")
    assert {"snapkv", "kvzap", "ada-kvzap", "ada-snapkv"} <= set(valid)
    assert not {"pyramidkv", "ada-pyramidkv"} & set(valid) and "\n" not in message


def test_chunk_by_chunk_needs_a_scorer_whose_heads_score_alone(scorer_dir, tmp_path):
    mixed = tmp_path / "mixed"
    random_scorer(LAYERS, HEADS, DIM, per_head=False).save(mixed)
    server = EvictionConfig("kvzap", 64, {"scorer": str(mixed)})
    with pytest.raises(EvictionConfigError, match="prefill=chunked: scorer .* every head's row of a token"):
        parse_override({"kv_prefill": "chunked"}, server)
    assert parse_override({"kv_prefill": "whole"}, server).prefill == "whole"
    separable = EvictionConfig("kvzap", 64, {"scorer": scorer_dir})
    assert parse_override({"kv_prefill": "chunked"}, separable).prefill == "chunked"


def test_a_scorer_directory_that_is_no_scorer_is_refused_when_the_config_is_read(tmp_path):
    with pytest.raises(EvictionConfigError, match="is not a scorer directory.*vllm-kvevict calibrate"):
        EvictionConfig.from_dict({"method": "kvzap", "budget": 64, "params": {"scorer": str(tmp_path)}})
