"""Prefill a prompt once and keep what eviction needs: the cache, per-layer ``LayerKV`` and the next-token
logits. Every method and budget is then judged on the same tensors without running the prompt again."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from vllm_kvevict.hf_reference.attention import LayerRecorder
from vllm_kvevict.hf_reference.model import attention_modules, o_proj_weights, rope_inv_freq
from vllm_kvevict.policies.base import LayerKV


@dataclass
class PrefilledPrompt:
    """One prompt after a full-attention prefill (batch 1).

    input_ids: [n] int64; keys/values: per layer [1, kv_heads, n, d] in the model dtype (what a KV cache
    holds: post-RoPE keys); layers: per layer ``LayerKV`` in float32 with the captured queries (the last
    ``query_window`` positions, or all n) and the o_proj weight; last_logits: [vocab] float32, the logits
    after the last prompt token (the first generated token comes from them, before any eviction).
    """

    input_ids: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    layers: list[LayerKV]
    last_logits: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@contextmanager
def recording(model: PreTrainedModel, query_window: int | None) -> Iterator[list[LayerRecorder]]:
    """Attach a ``LayerRecorder`` to every attention layer for the duration of the block."""
    modules = attention_modules(model)
    recorders = [LayerRecorder(query_window) for _ in modules]
    for module, recorder in zip(modules, recorders, strict=True):
        module.kvevict_recorder = recorder
    try:
        yield recorders
    finally:
        for module in modules:
            del module.kvevict_recorder


@torch.inference_mode()
def prefill(
    model: PreTrainedModel, input_ids: torch.Tensor, query_window: int | None = None, capture: bool = True
) -> PrefilledPrompt:
    """Run ``input_ids`` ([n] or [1, n]) through ``model`` (loaded with ``load_reference_model``) with full
    attention, capturing per layer the post-RoPE keys, values and the last ``query_window`` queries
    (None: all n, which H2O and RoCo need). ``capture=False`` skips the ``LayerKV`` copies (layers = [])."""
    ids = input_ids.reshape(1, -1).to(model.device)
    cache = DynamicCache(config=model.config)
    with recording(model, query_window) if capture else nullcontext([]) as recorders:
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    num_layers = len(attention_modules(model))
    weights = o_proj_weights(model) if capture else []
    inv_freq = rope_inv_freq(model) if capture else None
    layers = []
    for idx, recorder in enumerate(recorders):
        assert recorder.queries is not None and recorder.keys is not None and recorder.values is not None
        n, w = recorder.keys.shape[1], recorder.queries.shape[1]
        layers.append(
            LayerKV(
                keys=recorder.keys,
                values=recorder.values,
                queries=recorder.queries,
                layer_idx=idx,
                num_layers=num_layers,
                query_positions=torch.arange(n - w, n),
                o_proj=weights[idx],
                rope_inv_freq=inv_freq,
            )
        )
    return PrefilledPrompt(
        input_ids=ids[0].cpu(),
        keys=[cache.layers[i].keys for i in range(num_layers)],
        values=[cache.layers[i].values for i in range(num_layers)],
        layers=layers,
        last_logits=out.logits[0, -1].float(),
    )


def capture_layers(
    model: PreTrainedModel, input_ids: torch.Tensor, query_window: int | None = None
) -> list[LayerKV]:
    """Per-layer ``LayerKV`` of a prompt: post-RoPE keys/values [kv_heads, n, d], queries [q_heads, w, d]
    of the last ``query_window`` positions (None: all), o_proj [hidden, q_heads * d], the RoPE inverse
    frequencies [d / 2]; float32."""
    return prefill(model, input_ids, query_window).layers


def context_layers(
    prompt: PrefilledPrompt, context_len: int, query_window: int | None = None
) -> list[LayerKV]:
    """The prompt's first ``context_len`` tokens as if they were the whole prompt (question-agnostic mode).

    Causal attention makes the prefix's keys, values and queries identical to a prefill of the prefix
    alone, so this slices instead of running the model again. Needs the captured queries to cover the
    prefix's last ``query_window`` positions (capture with ``query_window=None`` to be safe).
    """
    sliced = []
    for layer in prompt.layers:
        positions = layer.positions()
        start = 0 if query_window is None else context_len - min(query_window, context_len)
        take = (positions >= start) & (positions < context_len)
        if int(take.sum()) != context_len - start:
            raise ValueError(
                f"captured queries cover positions {int(positions[0])}..{int(positions[-1])}; the context's "
                f"window needs {start}..{context_len - 1}: capture with query_window=None"
            )
        sliced.append(
            LayerKV(
                keys=layer.keys[:, :context_len],
                values=layer.values[:, :context_len],
                queries=layer.queries[:, take],
                layer_idx=layer.layer_idx,
                num_layers=layer.num_layers,
                query_positions=positions[take],
                o_proj=layer.o_proj,
                rope_inv_freq=layer.rope_inv_freq,
            )
        )
    return sliced
