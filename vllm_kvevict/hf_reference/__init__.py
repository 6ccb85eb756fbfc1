"""Reference runner on HF transformers: capture a prompt's per-layer tensors, then generate with evicted
(layer, KV head, token) entries masked out. The yardstick for the vLLM integration and the quality report."""

from vllm_kvevict.hf_reference.capture import PrefilledPrompt, capture_layers, context_layers, prefill
from vllm_kvevict.hf_reference.eviction import kept_per_layer, kept_ranked_across_layers, kvpress_kept_count
from vllm_kvevict.hf_reference.generation import (
    decode_batch_with_kept,
    decode_with_kept,
    evicted_mask,
    generate_with_kept,
)
from vllm_kvevict.hf_reference.model import load_reference_model

__all__ = [
    "PrefilledPrompt",
    "capture_layers",
    "context_layers",
    "decode_batch_with_kept",
    "decode_with_kept",
    "evicted_mask",
    "generate_with_kept",
    "kept_per_layer",
    "kept_ranked_across_layers",
    "kvpress_kept_count",
    "load_reference_model",
    "prefill",
]
