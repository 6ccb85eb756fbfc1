"""Every refusal of an attention layer fires through the shared backend part, on the CPU backend and on the
GPU (Triton) backend alike: a model or cache feature no backend can evict correctly stops the engine at
start-up with one line, before any request is served."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_kvevict.settings.config import EvictionConfig, EvictionConfigError  # noqa: E402
from vllm_kvevict.vllm_adapter import evicting_backend  # noqa: E402
from vllm_kvevict.vllm_adapter.backend_cpu import EvictingCPUAttentionImpl  # noqa: E402
from vllm_kvevict.vllm_adapter.backend_cuda import EvictingTritonAttentionImpl  # noqa: E402

BACKENDS = [EvictingCPUAttentionImpl, EvictingTritonAttentionImpl]
PLAIN = dict(alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto", sinks=None)
CASES = {
    "ALiBi slopes": dict(alibi_slopes=[0.5, 0.25]),
    "a sliding window": dict(sliding_window=4096),
    "attention sinks": dict(sinks=torch.zeros(2)),
}


def make_impl(cls, **features):
    args = PLAIN | features
    return cls(
        num_heads=2, head_size=64, scale=0.125, num_kv_heads=1, alibi_slopes=args["alibi_slopes"],
        sliding_window=args["sliding_window"], kv_cache_dtype=args["kv_cache_dtype"], sinks=args["sinks"],
    )


@pytest.fixture
def eviction_on(monkeypatch):
    from vllm.v1.attention.backends import cpu_attn

    # vLLM's CPU impl reads the model dtype of the config it is built under
    model = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: model)

    def configure(config: dict) -> None:
        config_of = EvictionConfig.from_dict(config)
        monkeypatch.setattr(evicting_backend, "get_eviction_config", lambda _: config_of)

    configure({"method": "snapkv", "budget": 256})
    return configure


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("feature", list(CASES))
def test_an_attention_feature_the_head_as_sequence_call_cannot_pass_is_refused(cls, feature, eviction_on):
    with pytest.raises(EvictionConfigError, match=f"kv eviction refused: .*{feature}"):
        make_impl(cls, **CASES[feature])


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_an_fp8_cache_is_served_with_a_decode_cap_and_chunked_prefill(cls, eviction_on, monkeypatch):
    """Its rows are read back dequantised (``quantised_rows``), so neither mode refuses it any more."""
    eviction_on({"method": "snapkv", "budget": 256, "decode": {"method": "roco", "budget": 128}})
    scheduler = SimpleNamespace(scheduler_config=SimpleNamespace(enable_chunked_prefill=True))
    monkeypatch.setattr(evicting_backend, "get_current_vllm_config_or_none", lambda: scheduler)
    for dtype in ("fp8", "fp8_e5m2"):
        assert make_impl(cls, kv_cache_dtype=dtype).kv_cache_dtype == dtype


def test_a_cache_with_per_token_head_scales_is_refused(eviction_on):
    """vLLM's Triton backend keeps such scales in caches of their own, which eviction does not move."""
    with pytest.raises(EvictionConfigError, match="fp8_per_token_head"):
        make_impl(EvictingTritonAttentionImpl, kv_cache_dtype="fp8_per_token_head")


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_a_plain_layer_is_served_and_eviction_off_refuses_nothing(cls, eviction_on, monkeypatch):
    assert make_impl(cls).num_kv_heads == 1
    monkeypatch.setattr(evicting_backend, "get_eviction_config", lambda _: None)
    assert make_impl(cls, sliding_window=4096) is not None  # plain vLLM: not ours to refuse


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_both_backends_take_every_shared_step_from_the_shared_part(cls):
    """The dispatch, head-as-sequence gather/scatter and refusals are inherited, not copied."""
    for name in ("forward", "do_kv_cache_update", "_head_sequence_attention", "layer_index", "__init__"):
        assert name not in vars(cls), f"{cls.__name__} redefines the shared {name}"
        assert getattr(cls, name) is getattr(evicting_backend.EvictingImpl, name)
