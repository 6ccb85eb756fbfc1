"""Calibration samples: KVzip+ log-scores of every context token with the cache rows they are predicted from.

A context is wrapped as a chat user turn (the template's text before the content, then the context) and
scored by ``hf_reference.kvzip.kvzip_scores`` with the KVzip+ normalisation; the target is the log of that
score (KVzap's target). Only the context's own tokens are kept: the template prefix is not reconstructed, so
it has no score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from vllm_kvevict.hf_reference.kvzip import chat_template_parts, encode, kvzip_scores

#: KVzip+ scores below this are clamped before the log (an exact zero would be -inf)
SCORE_FLOOR = 1e-12


@dataclass
class ContextSample:
    """One calibration context of c tokens.

    keys/values: per layer [kv_heads, c, d] post-RoPE keys and values as the cache holds them;
    hidden: per layer [c, hidden] attention inputs (KVzap's features, a comparison point only) or None;
    targets: [layers, kv_heads, c] float32 log KVzip+ scores.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: list[torch.Tensor] | None
    targets: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.targets.shape[-1])


def context_sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context_ids: list[int],
    chunk_size: int = 2048,
    keep_hidden: bool = False,
) -> ContextSample:
    """The ``ContextSample`` of one context (token ids without special tokens)."""
    prefix_text, _ = chat_template_parts(tokenizer)
    prefix = encode(tokenizer, prefix_text)
    start = prefix.shape[0]
    ids = torch.cat([prefix, torch.tensor(context_ids, dtype=torch.int64)])
    result = kvzip_scores(
        model, tokenizer, ids, context_start=start, chunk_size=chunk_size, plus=True, keep_hidden=keep_hidden
    )
    return ContextSample(
        keys=[k[:, start:].cpu() for k in result.keys],
        values=[v[:, start:].cpu() for v in result.values],
        hidden=[h[start:].cpu() for h in result.hidden] if result.hidden is not None else None,
        targets=torch.log(result.scores[:, :, start:].clamp_min(SCORE_FLOOR)).cpu(),
    )
