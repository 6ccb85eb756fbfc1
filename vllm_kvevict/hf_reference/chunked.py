"""The HF reference of per-chunk eviction: a prompt prefilled segment by segment, each segment's queries
seeing only what the server's heads held after the previous evicting chunk (``evicting`` masks), then
teacher-forced decoding with the prompt's final kept sets. Positions stay the true ones throughout."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from transformers import DynamicCache, PreTrainedModel

from vllm_kvevict.hf_reference.generation import evicting
from vllm_kvevict.policies.base import KeptTokens

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
