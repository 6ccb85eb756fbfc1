"""The HF reference of per-chunk eviction: a prompt prefilled segment by segment, each segment's queries
seeing only what the heads held after the previous evicting chunk (``evicting`` masks). Two uses:
``teacher_forced_after_chunks`` replays what a server held (its debug dump) and teacher-forces its tokens;
``chunked_prefill`` selects the held sets itself with the server's rule and methods, for quality runs.
Positions stay the true ones throughout."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from vllm_kvevict.datapath.question_echo import echo_policy
from vllm_kvevict.hf_reference.capture import PrefilledPrompt, recording
from vllm_kvevict.hf_reference.generation import evicting
from vllm_kvevict.hf_reference.model import o_proj_weights, rope_inv_freq
from vllm_kvevict.layout.accounting import RequestPlan
from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens, LayerKV
from vllm_kvevict.policies.between_chunks import (
    DEFAULT_BETWEEN,
    BetweenRule,
    between_chunks,
)
from vllm_kvevict.policies.query_statistics import QueryStatistics

#: (computed tokens after an evicting chunk, per layer what each head held then).
ChunkHeld = tuple[int, Sequence[KeptTokens]]


@torch.inference_mode()
def teacher_forced_after_chunks(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    chunks: Sequence[ChunkHeld],
    final_kept: Sequence[KeptTokens],
    tokens: torch.Tensor,
) -> torch.Tensor:
    """[T, vocab] float32 log-probabilities of each decode step along ``tokens`` [T] (step 0 from the last
    prompt segment's logits): segment [n_k, n_{k+1}) attends to the entries held after chunk k (positions
    < n_k) and to its own tokens causally; decoding attends to ``final_kept`` and the decoded tokens."""
    ids = torch.as_tensor(list(prompt_ids), device=model.device)
    cache = DynamicCache(config=model.config)
    start, held = 0, None
    logits = None
    for end, next_held in [*chunks, (len(ids), None)]:
        masks = evicting(model, [list(held)], start) if held is not None else nullcontext()
        with masks:
            out = model(
                input_ids=ids[None, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1
            )
        logits = out.logits[0, -1].float()
        start, held = end, next_held
    assert logits is not None
    with evicting(model, [list(final_kept)], len(ids)):
        out = model(input_ids=tokens[None, :-1].to(model.device), past_key_values=cache, use_cache=True)
    return torch.log_softmax(torch.cat([logits[None], out.logits[0].float()]), dim=-1)


@dataclass
class ChunkedPrefill:
    """A prompt prefilled chunk by chunk under per-chunk eviction, as the server does it.

    prompt: the resulting cache (keys/values [1, H, n, d]: entries computed under the chunks' masks) and the
    last chunk's logits; kept: per layer the prompt's final kept positions; chunks: the held sets after each
    evicting chunk (``teacher_forced_after_chunks``'s input)."""

    prompt: PrefilledPrompt
    kept: list[KeptTokens]
    chunks: list[ChunkHeld]


@torch.inference_mode()
def chunked_prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    policy: EvictionPolicy,
    plan: RequestPlan,
    chunk: int,
    between: BetweenRule | str = DEFAULT_BETWEEN,
    echo: Sequence[int] = (),
    between_echo: Sequence[int] = (),
) -> ChunkedPrefill:
    """Prefill ``input_ids`` [n] in chunks of ``chunk`` tokens with ``plan``'s per-chunk rule (the server's
    ``RequestPlan``): after a chunk that moves the offset every layer keeps ``a(n)`` entries per head with
    ``between_chunks(policy)`` (scored from the held entries in position order and the chunk's last window
    of queries), and the final chunk keeps the plan's layer budgets with ``policy`` itself — the selection
    of ``datapath/chunk_eviction.py``, in float32 on HF's cache. The window must fit in one chunk.
    ``between``: how the held entries are judged between chunks (a ``BetweenRule``, or its kind alone).
    Every layer's pre-RoPE query statistics are carried across chunks (``LayerKV.query_statistics``, what
    Expected Attention judges by, between chunks and at the end).
    A plan with a trailing window (``RequestPlan.trailing_window``, FastKVzip's rule) holds its ``a(n)`` with
    the arrived part of the window kept whole (``between_chunks(..., tail=...)``), as the server does.
    ``echo`` (the question echo, ``datapath/question_echo.py``): tokens run after the last chunk at positions
    ``n ..`` with what the heads hold in view; their queries judge the final selection beside the prompt's
    own last window (the method's ``echo_policy`` copy), as the server does. ``between_echo``: tokens run
    so after every earlier evicting chunk too (at the positions right after it), whose queries judge the
    between-chunks selection beside the chunk's last window; the cache keeps none of them."""
    ids = input_ids.reshape(-1).to(model.device)
    total = int(ids.shape[0])
    final_policy = _echoed(policy, len(echo))
    between_policy = _echoed(policy, len(between_echo))
    intermediate = between_chunks(policy, between)  # its observation window (the span does not change it)
    if total != plan.prompt_len:
        raise ValueError(f"plan is for {plan.prompt_len} tokens, the prompt has {total}")
    cache = DynamicCache(config=model.config)
    weights = o_proj_weights(model)
    num_layers = len(weights)
    inv_freq = rope_inv_freq(model)
    statistics = [QueryStatistics(inv_freq.to(ids.device)) for _ in range(num_layers)]
    held: list[torch.Tensor] | None = None  # per layer [H, a] positions held after the last eviction
    held_end = 0  # tokens computed at the last eviction: every later one is held
    history: list[ChunkHeld] = []
    start, logits = 0, None
    while start < total:
        end = min(total, start + chunk)
        final = end == total
        window = max(policy.query_window(end), intermediate.query_window(end))
        masks = evicting(model, [positions_as_kept(held)], held_end) if held is not None else nullcontext()
        with masks, recording(model, None) as recorders:  # every query of the chunk: the statistics
            out = model(
                input_ids=ids[None, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1
            )
        logits = out.logits[0, -1].float()
        for stats, recorder in zip(statistics, recorders, strict=True):
            stats.update(recorder.queries, torch.arange(start, end, device=ids.device))
        if final or plan.chunk_rescores(start, end):
            echoed = echo if final else between_echo
            echo_query = _echo_queries(model, cache, echoed, end, held, held_end) if echoed else None
            kept = []
            for layer_idx, recorder in enumerate(recorders):
                positions = torch.arange(end, device=ids.device)
                heads = recorder.keys.shape[0]
                positions = positions.expand(heads, end)
                if held is not None:
                    new = torch.arange(held_end, end, device=ids.device).expand(heads, end - held_end)
                    positions = torch.cat([held[layer_idx], new], dim=1)
                keys = recorder.keys.gather(1, positions[..., None].expand(-1, -1, recorder.keys.shape[2]))
                values = recorder.values.gather(
                    1, positions[..., None].expand(-1, -1, recorder.values.shape[2])
                )
                own = recorder.queries[:, max(0, recorder.queries.shape[1] - window) :]
                queries, query_positions = own, None
                if echo_query is not None:  # the chunk's last window, then the echo after the held entries
                    own = own[:, own.shape[1] - min(policy.query_window(end), own.shape[1]) :]
                    queries = torch.cat([own, echo_query[layer_idx]], dim=1)
                    held_count = positions.shape[1]
                    query_positions = torch.arange(
                        held_count - own.shape[1], held_count + len(echoed), device=ids.device
                    )
                layer = LayerKV(
                    keys=keys,
                    values=values,
                    queries=queries,
                    query_positions=query_positions,
                    layer_idx=layer_idx,
                    num_layers=num_layers,
                    o_proj=weights[layer_idx],
                    rope_inv_freq=inv_freq,
                    query_statistics=statistics[layer_idx],
                )
                if final:
                    budget, selector = plan.layer_budgets[layer_idx], final_policy
                else:
                    budget = plan.kept_length_at(end)
                    tail = plan.trailing_held(end)[1]
                    selector = between_chunks(between_policy, between, budget, tail)
                choice = selector.select(layer, min(budget, layer.num_tokens))
                kept.append(KeptTokens(gather_kept(positions, choice), choice.counts))
            if final:
                return ChunkedPrefill(cached_prompt(ids, cache, logits), kept, history)
            history.append((end, kept))
            held, held_end = [k.indices for k in kept], end
        start = end
    raise AssertionError("unreachable: the last chunk returns")


def _echoed(policy: EvictionPolicy, width: int) -> EvictionPolicy:
    """``policy`` reading ``width`` echo queries after its own window (itself when ``width`` is 0)."""
    if not width:
        return policy
    echoed = echo_policy(policy, width)
    if echoed is None:
        raise ValueError(f"{type(policy).__name__} reads no bounded query window: it cannot take an echo")
    return echoed


def _echo_queries(
    model: PreTrainedModel,
    cache: DynamicCache,
    tokens: Sequence[int],
    end: int,
    held: Sequence[torch.Tensor] | None,
    held_end: int,
) -> list[torch.Tensor]:
    """Per layer [q_heads, w, d] post-RoPE queries of ``tokens`` run at positions ``end ..`` over the
    ``end`` cached tokens as the heads hold them (``held`` before ``held_end``, every later one); the cache
    is cut back to ``end`` tokens after."""
    ids = torch.tensor([list(tokens)], device=model.device)
    positions = torch.arange(end, end + len(tokens), device=model.device)[None]
    masks = evicting(model, [positions_as_kept(held)], held_end) if held is not None else nullcontext()
    with masks, recording(model, None) as recorders:
        model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.crop(-len(tokens))
    return [recorder.queries for recorder in recorders]


def cached_prompt(ids: torch.Tensor, cache: DynamicCache, last_logits: torch.Tensor) -> PrefilledPrompt:
    """The prompt ``ids`` [n] as a chunked prefill left it: the cache's keys/values per layer (entries
    computed under the chunks' masks) and the last chunk's logits."""
    return PrefilledPrompt(
        input_ids=ids.cpu(),
        keys=[layer.keys for layer in cache.layers],
        values=[layer.values for layer in cache.layers],
        layers=[],
        last_logits=last_logits,
    )


def positions_as_kept(held: Sequence[torch.Tensor]) -> list[KeptTokens]:
    """Per layer ``KeptTokens`` of held positions [H, a] (every head the same count)."""
    return [KeptTokens(p, torch.full((p.shape[0],), p.shape[1], dtype=torch.int64)) for p in held]


def gather_kept(positions: torch.Tensor, kept: KeptTokens) -> torch.Tensor:
    """[H, M] positions of ``kept`` (indices into ``positions`` [H, L]), -1 padded, ascending per head."""
    index = kept.indices.clamp(min=0)
    return torch.where(kept.indices >= 0, positions.gather(1, index), -1)
