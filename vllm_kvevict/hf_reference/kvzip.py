"""KVzip (Kim et al., 2025, arXiv 2505.23416): question-agnostic scores from context reconstruction.

With the context in its cache, the model is fed "Repeat the previous context exactly." + the chat template's
assistant header + the context again. A context key's score is the largest attention it receives from any
reconstruction token, over the query heads of its KV group. Long contexts are reconstructed in chunks of
``chunk_size`` tokens; chunk i > 0 is asked "Repeat the part of the previous context exactly, starting with"
+ the previous chunk's last 8 tokens, and its softmax covers only the sinks, the chunk and the
reconstruction tokens (kvpress 0.5.5 ``KVzipPress``, which this follows). KVzip+ (the KVzap paper, arXiv
2601.07891) divides each reconstruction token's row by its hidden state's norm and multiplies each key's
column by ``||v W_O||`` of its value: the size of what the entry writes into the residual stream.

It costs a second prefill of the context, so it is a reference method (the HF runner) and the target that
``vllm-kvevict calibrate`` fits the servable surrogate (``policies/surrogate_scorer.py``) to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from vllm_kvevict.hf_reference.model import attention_modules
from vllm_kvevict.policies.base import LayerKV, ScoredPolicy, check_int

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
#: tokens of the previous chunk quoted after ``LATER_PROMPT``
PREVIOUS_TAIL = 8


def chat_template_parts(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """(text before a user message's content, text from its end to the assistant header), as kvpress
    finds them; ("", "\\n") for a tokenizer without a chat template."""
    if tokenizer.chat_template is None:
        return "", "\n"
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy + separator}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=False,
    )
    before, suffix = text.split(separator)
    return before.split(dummy)[0], suffix


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> torch.Tensor:
    """[m] int64 ids of ``text`` without special tokens."""
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.int64)


@dataclass(frozen=True)
class ReconstructionChunk:
    """Context positions [start, end) and the ids [m] that make the model repeat them."""

    start: int
    end: int
    repeat_ids: torch.Tensor


def reconstruction_chunks(
    tokenizer: PreTrainedTokenizerBase, input_ids: torch.Tensor, context_start: int, chunk_size: int
) -> list[ReconstructionChunk]:
    """The chunks of ``input_ids[context_start:]`` ([n] ids) and their reconstruction prompts."""
    _, suffix_text = chat_template_parts(tokenizer)
    suffix = encode(tokenizer, suffix_text)
    context = input_ids[context_start:].cpu()
    chunks, previous = [], None
    for offset in range(0, context.shape[0], chunk_size):
        part = context[offset : offset + chunk_size]
        if previous is None:
            ask = encode(tokenizer, FIRST_PROMPT)
        else:
            ask = torch.cat([encode(tokenizer, LATER_PROMPT), previous[-PREVIOUS_TAIL:]])
        start = context_start + offset
        chunks.append(ReconstructionChunk(start, start + part.shape[0], torch.cat([ask, suffix, part])))
        previous = part
    return chunks


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def reconstruction_queries(module: torch.nn.Module, hidden: torch.Tensor, cos_sin) -> torch.Tensor:
    """[q_heads, m, d] post-RoPE queries of the reconstruction tokens from their attention inputs
    ``hidden`` [m, hidden_size]."""
    m = hidden.shape[0]
    queries = module.q_proj(hidden).view(m, -1, module.head_dim).transpose(0, 1)
    if hasattr(module, "q_norm"):  # Qwen3-style query norm before RoPE
        queries = module.q_norm(queries)
    cos, sin = (t.reshape(m, -1) for t in cos_sin)
    return queries * cos + rotate_half(queries) * sin


def value_output_norms(o_proj: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[kv_heads, group, n] ``||v W_O||`` per query head of each value's group; o_proj [hidden, q_heads * d],
    values [kv_heads, n, d]."""
    heads, _, dim = values.shape
    weight = o_proj.view(o_proj.shape[0], heads, -1, dim)  # [hidden, H, g, d]
    return torch.einsum("jhgi,hti->hgtj", weight, values).norm(dim=-1)


def chunk_layer_scores(
    module: torch.nn.Module,
    hidden: torch.Tensor,
    cos_sin,
    keys: torch.Tensor,
    values: torch.Tensor,
    chunk: ReconstructionChunk,
    n_sink: int,
    plus: bool,
) -> torch.Tensor:
    """[kv_heads, end - start] scores of the chunk's context keys in one layer.

    hidden: [m, hidden] attention inputs of the m reconstruction tokens; keys/values: [kv_heads, N + m, d]
    the layer's cache with the reconstruction tokens appended last.
    """
    m = hidden.shape[0]
    queries = reconstruction_queries(module, hidden, cos_sin)  # [Hq, m, d]
    heads, _, dim = keys.shape
    group = queries.shape[0] // heads
    sink = min(n_sink, chunk.start)
    seen = torch.cat([keys[:, :sink], keys[:, chunk.start : chunk.end], keys[:, -m:]], dim=1)
    logits = queries.view(heads, group, m, dim) @ seen.transpose(-1, -2).unsqueeze(1) / math.sqrt(dim)
    causal = torch.ones(m, m, dtype=torch.bool, device=logits.device).triu(1)
    logits[..., -m:].masked_fill_(causal, float("-inf"))
    weights = logits.softmax(dim=-1)[..., sink : sink + chunk.end - chunk.start]  # [H, g, m, c]
    if plus:
        weights = weights / hidden.norm(dim=-1).view(1, 1, m, 1)
        norms = value_output_norms(module.o_proj.weight, values[:, chunk.start : chunk.end])
        weights = weights * norms.unsqueeze(2)
    return weights.amax(dim=(1, 2))


@dataclass
class KVzipResult:
    """KVzip scores of a prompt and what its prefill cached.

    scores: [layers, kv_heads, n] float32 (0 before ``context_start``: those tokens are not reconstructed);
    keys/values: per layer [kv_heads, n, d] post-RoPE keys and values as the cache holds them;
    hidden: per layer [n, hidden] attention inputs (KVzap's features), or None when not asked for.
    """

    scores: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: list[torch.Tensor] | None


@torch.inference_mode()
def kvzip_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    input_ids: torch.Tensor,
    context_start: int = 0,
    chunk_size: int = 2048,
    n_sink: int = 4,
    plus: bool = False,
    keep_hidden: bool = False,
) -> KVzipResult:
    """Prefill ``input_ids`` ([n]: a chat template's user prefix of ``context_start`` tokens, then the
    context), then reconstruct the context chunk by chunk and score every context key (KVzip, or KVzip+
    with ``plus``). The cache is cut back to n after each chunk, so every chunk sees the context only."""
    check_int("kvzip", "chunk_size", chunk_size, 1)
    ids = input_ids.reshape(-1).to(model.device)
    n = ids.shape[0]
    modules = attention_modules(model)
    cache = DynamicCache(config=model.config)
    hidden: list[torch.Tensor | None] = [None] * len(modules)

    def keep_input(idx: int):
        def hook(module, args, kwargs):
            hidden[idx] = kwargs["hidden_states"][0].float().clone()

        return hook

    handles = [m.register_forward_pre_hook(keep_input(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        model.model(input_ids=ids[None], past_key_values=cache, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    keys = [cache.layers[i].keys[0].float().clone() for i in range(len(modules))]
    values = [cache.layers[i].values[0].float().clone() for i in range(len(modules))]
    scores = torch.zeros(len(modules), keys[0].shape[0], n, dtype=torch.float32, device=ids.device)
    for chunk in reconstruction_chunks(tokenizer, ids, context_start, chunk_size):

        def score_layer(idx: int, chunk: ReconstructionChunk = chunk):
            def hook(module, args, kwargs, output):
                layer = kwargs["past_key_values"].layers[idx]
                scores[idx, :, chunk.start : chunk.end] = chunk_layer_scores(
                    module,
                    kwargs["hidden_states"][0].float(),
                    kwargs["position_embeddings"],
                    layer.keys[0].float(),
                    layer.values[0].float(),
                    chunk,
                    n_sink,
                    plus,
                )

            return hook

        handles = [m.register_forward_hook(score_layer(i), with_kwargs=True) for i, m in enumerate(modules)]
        try:
            model.model(
                input_ids=chunk.repeat_ids[None].to(ids.device), past_key_values=cache, use_cache=True
            )
        finally:
            for handle in handles:
                handle.remove()
        cache.crop(-chunk.repeat_ids.shape[0])  # back to the context alone
    return KVzipResult(scores, keys, values, hidden if keep_hidden else None)  # type: ignore[arg-type]


def global_kept(scores: torch.Tensor, compression_ratio: float, n_sink: int = 4) -> torch.Tensor:
    """[layers, kv_heads, n] bool kept entries: the ``compression_ratio`` share of all entries with the lowest
    scores is evicted across layers and heads at once, the first ``n_sink`` tokens never (kvpress's
    ``KVzipPress`` with ``layerwise=False``)."""
    ranked = scores.clone()
    ranked[..., :n_sink] = ranked.amax() + 1.0
    evicted = int(ranked.numel() * compression_ratio)
    keep = torch.ones(ranked.numel(), dtype=torch.bool, device=ranked.device)
    keep[torch.topk(-ranked.reshape(-1), evicted).indices] = False
    return keep.view_as(ranked)


@dataclass
class KVzipPolicy(ScoredPolicy):
    """KVzip as a method of the HF runner: precomputed scores [layers, kv_heads, n] (``kvzip_scores``) ranked
    per head, the first ``sinks`` tokens always kept. The scores come from a second prefill, so this is not
    a served method; its served surrogate is ``SurrogateScorer``."""

    scores: torch.Tensor
    sinks: int = 4

    def __post_init__(self) -> None:
        check_int("kvzip", "sinks", self.sinks, 0)

    @property
    def min_budget(self) -> int:
        return self.sinks

    def always_kept(self, num_tokens: int, budget: int) -> torch.Tensor:
        return torch.arange(min(self.sinks, num_tokens))

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        scores = self.scores[layer.layer_idx, :, : layer.num_tokens].float().clone()
        scores[:, : self.sinks] = float("inf")
        return scores
