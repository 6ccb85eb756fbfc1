"""Per request with a learned method: HTTP 400 naming calibrate where the served model has no scorer, the
kept context an ada-kvzap request keeps as kvzap (the served default ada-snapkv stays refused, saying why),
and chunk by chunk only with a scorer whose heads score alone."""

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
from vllm_kvevict.settings.request_settings import RequestSettings, parse_override
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


def test_an_ada_kvzap_request_keeping_a_context_runs_as_kvzap_with_the_servers_scorer(scorer_dir):
    server = EvictionConfig("ada-kvzap", 64, {"scorer": scorer_dir, "window": 16, "alpha": 0.3})
    settings = RequestSettings(server, BS, LAYERS)
    keep = settings.resolve({"kv_context": "keep"})
    assert keep.method == "kvzap" and keep.keeps_context
    assert keep.policy.scorer == scorer_dir and keep.policy.window == 16  # alpha is Ada-KV's: not taken
    assert len(set(keep.plan_for(1000).layer_budgets)) == 1  # one count for every head and layer
    asked_as_kvzap = settings.resolve({"kv_eviction": "kvzap", "kv_context": "keep"})
    assert asked_as_kvzap.identity == keep.identity  # the same kept set: one entry serves both
    assert settings.resolve({"kv_budget": 0.5}).method == "ada-kvzap"  # without keep: Ada-KV


def test_the_served_default_keeping_a_context_stays_refused_naming_why_and_the_learned_methods():
    with pytest.raises(EvictionConfigError) as raised:
        parse_override({"kv_context": "keep"}, DEFAULT_SERVER)
    message = str(raised.value)
    assert "kv_eviction='ada-snapkv': a kept context needs a method that keeps the same count" in message
    valid = message.split("valid: ")[1].split(" (")[0].split(", ")
    assert {"snapkv", "kvzap", "ada-kvzap"} <= set(valid) and "ada-snapkv" not in valid
    assert "ada-snapkv is not switched to snapkv" in message and "Kept contexts" in message


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
