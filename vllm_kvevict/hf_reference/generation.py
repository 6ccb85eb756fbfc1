"""Greedy generation after per-head eviction, by masking: every evicted (layer, KV head, token) entry is
hidden from all later queries; tokens after the evicted span stay visible; positions stay the true ones.

This is what the vLLM integration computes with compacted sub-blocks, so its decode logits can be checked
against ``generate_with_kept`` on the same kept sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from vllm_kvevict.hf_reference.capture import PrefilledPrompt, prefill
from vllm_kvevict.hf_reference.model import as_model, attention_modules
from vllm_kvevict.policies.base import KeptTokens


def evicted_mask(kept: KeptTokens, num_tokens: int) -> torch.Tensor:
    """[kv_heads, num_tokens] bool, True where a token is not in the head's kept set."""
    indices, counts = kept.indices.cpu(), kept.counts.cpu()
    counted = torch.arange(indices.shape[1]) < counts[:, None]  # each head's first counts[h] entries
    outside = counted & ((indices < 0) | (indices >= num_tokens))
    if bool(outside.any()):
        head = int(outside.any(dim=1).nonzero()[0])
        raise ValueError(f"head {head} keeps indices outside [0, {num_tokens})")
    return ~KeptTokens(torch.where(counted, indices, -1), counts).to_mask(num_tokens)


@contextmanager
def evicting(
    model: PreTrainedModel, kept_rows: Sequence[Sequence[KeptTokens]], num_tokens: int
) -> Iterator[None]:
    """Hide, for every batch row and layer, the evicted entries of the first ``num_tokens`` positions.

    kept_rows: per batch row, one ``KeptTokens`` per layer.
    """
    modules = attention_modules(model)
    for row in kept_rows:
        if len(row) != len(modules):
            raise ValueError(f"need one KeptTokens per layer ({len(modules)}); got {len(row)}")
    for idx, module in enumerate(modules):
        masks = [evicted_mask(row[idx], num_tokens) for row in kept_rows]
        module.kvevict_evicted = torch.stack(masks).to(model.device)
    try:
        yield
    finally:
        for module in modules:
            del module.kvevict_evicted


def cache_prefix(
    model: PreTrainedModel, prompt: PrefilledPrompt, length: int | None = None, batch: int = 1
) -> DynamicCache:
    """A fresh cache holding the prompt's first ``length`` tokens (default: all) for ``batch`` rows (copies;
    the prompt stays reusable)."""
    length = prompt.num_tokens if length is None else length
    cache = DynamicCache(config=model.config)
    for idx, (keys, values) in enumerate(zip(prompt.keys, prompt.values, strict=True)):
        keys = keys[:, :, :length].expand(batch, -1, -1, -1).clone(memory_format=torch.contiguous_format)
        values = values[:, :, :length].expand(batch, -1, -1, -1).clone(memory_format=torch.contiguous_format)
        cache.update(keys, values, idx)
    return cache


@torch.inference_mode()
def decode_batch_with_kept(
    model: PreTrainedModel,
    prompt: PrefilledPrompt,
    kept_rows: Sequence[Sequence[KeptTokens]],
    max_new_tokens: int,
    context_len: int | None = None,
    stop_token_ids: Sequence[int] = (),
    finished: Callable[[list[int]], bool] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``decode_with_kept`` for several kept sets of one prompt at once, one batch row each.

    A row stops growing after a stop token, ``max_new_tokens`` tokens, or when ``finished(tokens)`` says
    its answer is decided (the needle benchmark stops at the first wrong digit); the batch runs until
    every row has stopped. Returns per row (token_ids [T_r], logits [T_r, vocab]).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    n = prompt.num_tokens
    context_len = n if context_len is None else context_len
    if not 0 < context_len <= n:
        raise ValueError(f"context_len={context_len} must be in [1, {n}]")
    batch = len(kept_rows)
    stops = set(stop_token_ids)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    done = [False] * batch
    cache = cache_prefix(model, prompt, context_len, batch)
    with evicting(model, kept_rows, context_len):
        if context_len == n:
            step_logits = prompt.last_logits.expand(batch, -1)
        else:
            suffix = prompt.input_ids[context_len:].to(model.device).expand(batch, -1)
            out = model(input_ids=suffix, past_key_values=cache, use_cache=True, logits_to_keep=1)
            step_logits = out.logits[:, -1].float()
        while True:
            next_tokens = step_logits.argmax(dim=-1)
            for row in range(batch):
                if done[row]:
                    continue
                token = int(next_tokens[row])
                tokens[row].append(token)
                logits[row].append(step_logits[row].cpu())
                decided = finished is not None and finished(tokens[row])
                done[row] = len(tokens[row]) >= max_new_tokens or token in stops or decided
            if all(done):
                break
            out = model(input_ids=next_tokens[:, None], past_key_values=cache, use_cache=True)
            step_logits = out.logits[:, -1].float()
    return [
        (torch.tensor(row_tokens, dtype=torch.int64), torch.stack(row_logits))
        for row_tokens, row_logits in zip(tokens, logits, strict=True)
    ]


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
    return decode_batch_with_kept(model, prompt, [kept], max_new_tokens, context_len, stop_token_ids)[0]


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
