"""Each refusal of ``vllm_adapter/model_support.py``: one line naming the model feature and what is
supported, from fake vLLM config objects with only the attributes vLLM 0.32.0 gives them (and real KV-cache
specs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from vllm_kvevict.vllm_adapter import model_support
from vllm_kvevict.vllm_adapter.model_support import (
    attention_layer_refusal,
    cache_refusal,
    criticalkv_refusal,
    eviction_refusal,
    kv_spec_refusal,
    model_refusal,
)


def model_config(architecture: str = "LlamaForCausalLM", **flags) -> SimpleNamespace:
    """A vLLM ModelConfig as the checks read it; ``text`` entries go to ``hf_text_config``."""
    text = flags.pop("text", {})
    values = {
        "architectures": [architecture],
        "hf_text_config": SimpleNamespace(**text),
        "is_attention_free": False,
        "is_hybrid": False,
        "use_mla": False,
        "uses_alibi": lambda: False,
        "is_multimodal_model": False,
    }
    return SimpleNamespace(**{**values, **flags})


def assert_one_line_naming(refusal: str | None, *words: str) -> None:
    assert refusal is not None
    assert "\n" not in refusal
    assert refusal.startswith("kv eviction refused: ")
    for word in words:
        assert word in refusal, (word, refusal)


def test_a_full_attention_gqa_model_is_served():
    assert model_refusal(model_config(text={"num_key_value_heads": 2, "sliding_window": None})) is None


def test_qwen_style_sliding_window_switched_off_is_served():
    config = model_config("Qwen2ForCausalLM", text={"sliding_window": 4096, "use_sliding_window": False})
    assert model_refusal(config) is None


def test_layer_types_of_full_attention_only_are_served():
    text = {"sliding_window": 4096, "layer_types": ["full_attention"] * 4}
    assert model_refusal(model_config(text=text)) is None


def test_sliding_window_layers_mixed_with_full_ones_are_refused():
    text = {"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"] * 2}
    refusal = model_refusal(model_config("Gemma2ForCausalLM", text=text))
    assert_one_line_naming(refusal, "Gemma2ForCausalLM", "sliding-window", "512", "full causal attention")


def test_a_model_wide_sliding_window_is_refused():
    refusal = model_refusal(model_config("MistralForCausalLM", text={"sliding_window": 4096}))
    assert_one_line_naming(refusal, "MistralForCausalLM", "sliding-window", "4096")


def test_mla_is_refused():
    refusal = model_refusal(model_config("DeepseekV2ForCausalLM", use_mla=True))
    assert_one_line_naming(refusal, "DeepseekV2ForCausalLM", "multi-head latent attention")


def test_a_hybrid_model_is_refused():
    refusal = model_refusal(model_config("FalconH1ForCausalLM", is_hybrid=True))
    assert_one_line_naming(refusal, "FalconH1ForCausalLM", "hybrid")


def test_an_attention_free_model_is_refused():
    assert_one_line_naming(
        model_refusal(model_config("MambaForCausalLM", is_attention_free=True)), "attention-free"
    )


def test_alibi_is_refused():
    refusal = model_refusal(model_config("BloomForCausalLM", uses_alibi=lambda: True))
    assert_one_line_naming(refusal, "BloomForCausalLM", "ALiBi")


def test_a_multimodal_model_is_refused():
    refusal = model_refusal(model_config("LlavaForConditionalGeneration", is_multimodal_model=True))
    assert_one_line_naming(refusal, "multimodal")


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_cache_with_per_layer_scales_is_served_in_every_mode(dtype):
    """Its rows are read back through the layer's scales (``quantised_rows``): chunked prefill, decode caps
    and prefix caching no longer matter to the cache dtype."""
    assert cache_refusal(dtype) is None


def test_a_cache_whose_scales_eviction_does_not_move_is_refused_naming_the_dtype():
    refusal = cache_refusal("fp8_per_token_head")
    assert_one_line_naming(refusal, "fp8_per_token_head", "per token and head", "fp8_e5m2")


def spec(cls=FullAttentionSpec, **extra):
    return cls(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, **extra)


def test_full_attention_specs_are_served():
    assert (
        kv_spec_refusal({"model.layers.0.self_attn.attn": spec(), "model.layers.1.self_attn.attn": spec()})
        is None
    )


@pytest.mark.parametrize(
    ("other", "feature"),
    [
        (spec(SlidingWindowSpec, sliding_window=128), "sliding-window attention"),
        (MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32), "latent"),
    ],
)
def test_a_layer_whose_kv_spec_is_not_full_attention_is_refused_by_name(other, feature):
    refusal = kv_spec_refusal(
        {"model.layers.0.self_attn.attn": spec(), "model.layers.1.self_attn.attn": other}
    )
    assert_one_line_naming(refusal, "model.layers.1.self_attn.attn", type(other).__name__, feature)


def test_an_ssm_layer_of_a_hybrid_model_is_refused():
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    assert_one_line_naming(kv_spec_refusal({"model.layers.3.mixer": mamba}), "MambaSpec", "state-space")


@pytest.mark.parametrize(
    ("attributes", "words"),
    [
        ({"alibi_slopes": torch.ones(4)}, ("ALiBi",)),
        ({"sinks": torch.zeros(4)}, ("attention sinks",)),
        ({"sliding_window": 128}, ("sliding window", "128")),
        ({"sliding_window": (127, 0)}, ("sliding window",)),
    ],
)
def test_a_decoder_layer_with_alibi_sinks_or_a_window_is_refused(attributes, words):
    layer = {"alibi_slopes": None, "sinks": None, "sliding_window": -1, **attributes}
    refusal = attention_layer_refusal("model.layers.2.self_attn.attn", is_decoder=True, **layer)
    assert_one_line_naming(refusal, "model.layers.2.self_attn.attn", *words)


def test_plain_decoder_and_encoder_layers_pass():
    plain = {"alibi_slopes": None, "sinks": None}
    assert attention_layer_refusal("a", is_decoder=True, sliding_window=-1, **plain) is None
    assert attention_layer_refusal("a", is_decoder=True, sliding_window=None, **plain) is None
    assert attention_layer_refusal("a", is_decoder=False, sliding_window=128, **plain) is None


def test_criticalkv_without_o_proj_in_every_layer_is_refused_naming_the_layers():
    refusal = criticalkv_refusal("critical-ada-snapkv", o_proj_layers=[0, 1, 3], num_layers=4)
    assert_one_line_naming(refusal, "critical-ada-snapkv", "o_proj", "layers 2")
    assert criticalkv_refusal("critical-snapkv", o_proj_layers=range(4), num_layers=4) is None
    assert criticalkv_refusal("snapkv", o_proj_layers=[], num_layers=4) is None


def vllm_config(model, kv_eviction=None, cache_dtype="auto", chunked_prefill=False) -> SimpleNamespace:
    additional = {"kv_eviction": kv_eviction} if kv_eviction else {}
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked_prefill, max_num_batched_tokens=512),
        additional_config=additional,
    )


def test_eviction_refusal_checks_only_when_eviction_is_on():
    mla = model_config("DeepseekV2ForCausalLM", use_mla=True)
    assert eviction_refusal(vllm_config(mla)) is None
    refusal = eviction_refusal(vllm_config(mla, {"method": "snapkv", "budget": 256}))
    assert_one_line_naming(refusal, "multi-head latent attention")


def test_eviction_refusal_serves_an_fp8_cache_with_a_decode_cap_and_chunked_prefill():
    capped = {"method": "snapkv", "budget": 256, "decode": {"method": "roco", "budget": 128}}
    assert eviction_refusal(vllm_config(model_config(), capped, "fp8", chunked_prefill=True)) is None
    refusal = eviction_refusal(vllm_config(model_config(), capped, "int8_per_token_head"))
    assert_one_line_naming(refusal, "int8_per_token_head")


def test_the_supported_line_names_what_is_served():
    assert "full causal attention" in model_support.SUPPORTED
