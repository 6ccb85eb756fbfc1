"""The server's setting crosses a process boundary in one form (``additional_config.to_wire``/``from_wire``)
and travels typed past it: in the KV-cache spec, which vLLM pickles from the workers to the EngineCore and
back; a request's setting is parsed once per distinct setting, its values' types told apart."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import torch

from vllm_kvevict.settings.additional_config import from_wire, to_wire
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.request_settings import RequestSettings
from vllm_kvevict.vllm_adapter.kv_spec import EvictingAttentionSpec

ROCO = {"method": "roco", "budget": 256, "prefill": "whole"}  # implies a decode-time cap


def spec_of(config: EvictionConfig) -> EvictingAttentionSpec:
    return EvictingAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, eviction=config, num_model_layers=4
    )


def test_the_wire_form_reads_back_to_an_equal_config_as_a_dict_and_as_its_json_text():
    config = from_wire(ROCO)
    assert from_wire(to_wire(config)) == config
    assert from_wire(json.dumps(to_wire(config))) == config
    assert from_wire(config) == config and from_wire(None) is None and from_wire({}) is None


def test_a_spec_carries_its_config_typed_through_pickle():
    spec = spec_of(from_wire(ROCO))
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec and hash(back) == hash(spec)
    assert isinstance(back.eviction, EvictionConfig) and back.eviction.decode.method == "roco"
    assert back.eviction.pools_layers is False
    assert EvictingAttentionSpec.merge([spec, back]) == spec


def test_an_unpickled_config_hashes_like_one_built_in_the_receiving_process():
    """A hash computed in one process is never carried into another (each process seeds its own)."""
    code = (
        "import pickle, sys\n"
        "from vllm_kvevict.settings.additional_config import from_wire\n"
        "sent = pickle.loads(sys.stdin.buffer.read())\n"
        f"print(hash(sent) == hash(from_wire({ROCO!r})) and sent == from_wire({ROCO!r}))\n"
    )
    sent = pickle.dumps(from_wire(ROCO))
    result = subprocess.run([sys.executable, "-c", code], input=sent, capture_output=True, check=True)
    assert result.stdout.strip() == b"True"


def test_a_request_setting_is_parsed_once_per_value_and_type():
    settings = RequestSettings(from_wire({"method": "ada-snapkv", "budget": 0.25}), 16, 4)
    assert settings.resolve({"kv_question_echo": 0}).question_echo == 0
    assert settings.resolve({"kv_question_echo": False}) is None  # a bool is refused, though False == 0
    assert settings.resolve({"kv_question_echo": 0}) is settings.resolve({"kv_question_echo": 0})
    assert settings.resolve({"kv_budget": [0.1]}) is None  # an unhashable value: parsed, refused
