"""Greedy generation after per-head eviction, by masking: every evicted (layer, KV head, token) entry is
hidden from all later queries; tokens after the evicted span stay visible; positions stay the true ones.

This is what the vLLM integration computes with compacted sub-blocks, so its decode logits can be checked
against ``generate_with_kept`` on the same kept sets.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from vllm_kvevict.hf_reference.capture import PrefilledPrompt, prefill
from vllm_kvevict.hf_reference.model import as_model, attention_modules
from vllm_kvevict.policies.base import KeptTokens


def evicted_mask(kept: KeptTokens, num_tokens: int) -> torch.Tensor:
    """[kv_heads, num_tokens] bool, True where a token is not in the head's kept set."""
    kv_heads = kept.counts.shape[0]
    keep = torch.zeros(kv_heads, num_tokens, dtype=torch.bool)
    for h in range(kv_heads):
        indices = kept.head(h).cpu()
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_tokens):
            raise ValueError(f"head {h} keeps indices outside [0, {num_tokens})")
        keep[h, indices] = True
    return ~keep


@contextmanager
def evicting(model: PreTrainedModel, kept: Sequence[KeptTokens], num_tokens: int) -> Iterator[None]:
    """Hide the evicted entries of the first ``num_tokens`` cache positions in every layer."""
    modules = attention_modules(model)
    if len(kept) != len(modules):
        raise ValueError(f"need one KeptTokens per layer ({len(modules)}); got {len(kept)}")
    for module, layer_kept in zip(modules, kept, strict=True):
        module.kvevict_evicted = evicted_mask(layer_kept, num_tokens).to(model.device)
    try:
        yield
    finally:
        for module in modules:
            del module.kvevict_evicted


def _cache_prefix(model: PreTrainedModel, prompt: PrefilledPrompt, length: int) -> DynamicCache:
    """A fresh cache holding the prompt's first ``length`` tokens (copies; the prompt stays reusable)."""
    cache = DynamicCache(config=model.config)
    for idx, (keys, values) in enumerate(zip(prompt.keys, prompt.values, strict=True)):
        cache.update(keys[:, :, :length].clone(), values[:, :, :length].clone(), idx)
    return cache


@torch.inference_mode()
def decode_with_kept(
    model: PreTrainedModel,
    prompt: PrefilledPrompt,
    kept: Sequence[KeptTokens],
    max_new_tokens: int,
    context_len: int | None = None,
    stop_token_ids: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation of a prefilled prompt after eviction.

    kept: one ``KeptTokens`` per layer over the first ``context_len`` prompt tokens (default: all n).
    Question-aware (context_len == n): the first token comes from the full-attention prefill logits, as
    in vLLM where eviction follows the prefill; every later step sees only kept entries + new tokens.
    Question-agnostic (context_len < n): the prompt's tokens after ``context_len`` (the question) are run
    again on the evicted cache, then decoding goes on. Stops after ``max_new_tokens`` or a stop token.
    Returns (token_ids [T] int64, logits [T, vocab] float32), logits[t] being what chose token t.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    n = prompt.num_tokens
    context_len = n if context_len is None else context_len
    if not 0 < context_len <= n:
        raise ValueError(f"context_len={context_len} must be in [1, {n}]")
    stops = set(stop_token_ids)
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    cache = _cache_prefix(model, prompt, context_len)
    with evicting(model, kept, context_len):
        if context_len == n:
            step_logits = prompt.last_logits
        else:
            suffix = prompt.input_ids[context_len:].reshape(1, -1).to(model.device)
            out = model(input_ids=suffix, past_key_values=cache, use_cache=True, logits_to_keep=1)
            step_logits = out.logits[0, -1].float()
        while True:
            token = int(step_logits.argmax())
            tokens.append(token)
            logits.append(step_logits.cpu())
            if len(tokens) >= max_new_tokens or token in stops:
                break
            step = torch.tensor([[token]], device=model.device)
            out = model(input_ids=step, past_key_values=cache, use_cache=True)
            step_logits = out.logits[0, -1].float()
    return torch.tensor(tokens, dtype=torch.int64), torch.stack(logits)


def generate_with_kept(
    model_or_dir: PreTrainedModel | str | Path,
    input_ids: torch.Tensor,
    kept: Sequence[KeptTokens],
    max_new_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``input_ids`` ([n] or [1, n]) with full attention, keep per layer and KV head only the
    ``kept`` prompt entries, and decode greedily ``max_new_tokens`` tokens (no early stop).

    Returns (token_ids [max_new_tokens] int64, logits [max_new_tokens, vocab] float32). Keeping everything
    (``KeptTokens.everything``) reproduces plain HF greedy generation.
    """
    model = as_model(model_or_dir)
    prompt = prefill(model, input_ids, capture=False)
    return decode_with_kept(model, prompt, kept, max_new_tokens)
