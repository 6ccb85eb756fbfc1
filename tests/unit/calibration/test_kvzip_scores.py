"""KVzip's scores (``hf_reference/kvzip.py``) against a plain-torch recomputation on a tiny random Llama.

The recomputation runs the model once over the prompt followed by a chunk's reconstruction prompt (no cache:
causal attention gives the same keys as the cached run) and takes every layer's attention input from the
hidden states, then writes out the queries, RoPE, the softmax over the sinks, the chunk and the
reconstruction tokens, the KVzip+ factors and the maximum, step by step.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_kvevict.hf_reference.kvzip import (
    KVzipPolicy,
    chat_template_parts,
    encode,
    global_kept,
    kvzip_scores,
    reconstruction_chunks,
)
from vllm_kvevict.policies.base import LayerKV

pytestmark = pytest.mark.model

TEXT = "Alpha beta gamma delta. The quick brown fox jumps over the lazy dog, twice, in 1999. " * 3


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, N, d] rotated as Llama does (rotate-half layout), cos/sin [N, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def plain_scores(
    model, tokenizer, ids: torch.Tensor, start: int, chunk_size: int, plus: bool
) -> torch.Tensor:
    """[layers, kv_heads, n] KVzip(+) scores recomputed without a cache or hooks."""
    n = ids.shape[0]
    config = model.config
    heads, q_heads, dim = config.num_key_value_heads, config.num_attention_heads, config.head_dim
    group = q_heads // heads
    scores = torch.zeros(config.num_hidden_layers, heads, n)
    for chunk in reconstruction_chunks(tokenizer, ids, start, chunk_size):
        full = torch.cat([ids, chunk.repeat_ids])
        m = chunk.repeat_ids.shape[0]
        with torch.no_grad():
            out = model(input_ids=full[None], output_hidden_states=True)
            cos, sin = model.model.rotary_emb(out.hidden_states[0], torch.arange(full.shape[0])[None])
        cos, sin = cos[0], sin[0]  # [N, d]
        sink = min(4, chunk.start)
        columns = torch.cat(
            [torch.arange(sink), torch.arange(chunk.start, chunk.end), torch.arange(n, n + m)]
        )
        for idx, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            with torch.no_grad():
                h = layer.input_layernorm(out.hidden_states[idx][0])  # [N, hidden]
                q = attn.q_proj(h).view(-1, q_heads, dim).transpose(0, 1)
                k = attn.k_proj(h).view(-1, heads, dim).transpose(0, 1)
                v = attn.v_proj(h).view(-1, heads, dim).transpose(0, 1)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            for head in range(q_heads):
                kv = head // group
                rows = q[head, n:]  # [m, d]
                logits = rows @ k[kv, columns].T / math.sqrt(dim)  # [m, len(columns)]
                for r in range(m):  # causal among the reconstruction tokens
                    logits[r, len(columns) - m + r + 1 :] = float("-inf")
                weights = logits.softmax(dim=-1)[:, sink : sink + chunk.end - chunk.start]
                if plus:
                    w_o = attn.o_proj.weight[:, head * dim : (head + 1) * dim]  # [hidden, d]
                    value_norms = (v[kv, chunk.start : chunk.end] @ w_o.T).norm(dim=-1)
                    weights = weights / h[n:].norm(dim=-1, keepdim=True) * value_norms
                best = weights.amax(dim=0)
                span = scores[idx, kv, chunk.start : chunk.end]
                scores[idx, kv, chunk.start : chunk.end] = torch.maximum(span, best)
    return scores


@pytest.fixture(scope="module")
def prompt(tokenizer) -> tuple[torch.Tensor, int]:
    prefix = encode(tokenizer, chat_template_parts(tokenizer)[0])
    return torch.cat([prefix, encode(tokenizer, TEXT)]), int(prefix.shape[0])


@pytest.mark.parametrize(("chunk_size", "plus"), [(2048, False), (2048, True), (25, False), (25, True)])
def test_scores_equal_a_plain_recomputation(tiny_model, tokenizer, prompt, chunk_size, plus) -> None:
    ids, start = prompt
    assert ids.shape[0] - start > 2 * 25, "the chunked cases need three chunks or more"
    result = kvzip_scores(tiny_model, tokenizer, ids, context_start=start, chunk_size=chunk_size, plus=plus)
    expected = plain_scores(tiny_model, tokenizer, ids, start, chunk_size, plus)
    assert bool((result.scores[..., :start] == 0).all()), "the template prefix is not scored"
    assert bool((result.scores[..., start:] > 0).all())
    torch.testing.assert_close(result.scores, expected, rtol=1e-4, atol=1e-7)


def test_the_cache_holds_the_context_alone_and_keys_are_post_rope(tiny_model, tokenizer, prompt) -> None:
    ids, start = prompt
    result = kvzip_scores(tiny_model, tokenizer, ids, context_start=start, chunk_size=25, keep_hidden=True)
    n = ids.shape[0]
    assert [tuple(k.shape) for k in result.keys] == [(2, n, 8)] * 2
    assert result.hidden is not None and tuple(result.hidden[0].shape) == (n, 32)
    with torch.no_grad():
        layer = tiny_model.model.layers[0]
        h = layer.input_layernorm(tiny_model.model.embed_tokens(ids[None]))[0]
        pre_rope = layer.self_attn.k_proj(h).view(n, 2, 8).transpose(0, 1)
    # RoPE keeps every pair's length and leaves position 0 unrotated
    torch.testing.assert_close(result.keys[0][:, 0], pre_rope[:, 0])
    torch.testing.assert_close(result.keys[0].norm(dim=-1), pre_rope.norm(dim=-1))
    assert not torch.allclose(result.keys[0][:, 5:], pre_rope[:, 5:])


def test_global_kept_evicts_the_lowest_scores_across_layers_and_keeps_sinks() -> None:
    scores = torch.tensor([[[0.0, 0.1, 0.9, 0.2]], [[0.0, 0.8, 0.05, 0.7]]])  # [2 layers, 1 head, 4]
    kept = global_kept(scores, 0.25, n_sink=1)  # evicts 2 of 8: 0.05 and 0.1
    assert kept.tolist() == [[[True, False, True, True]], [[True, True, False, True]]]


def test_kvzip_policy_keeps_sinks_and_the_top_scores_per_head() -> None:
    scores = torch.tensor([[[0.0, 0.3, 0.9, 0.1, 0.5], [0.0, 0.9, 0.1, 0.8, 0.2]]])  # [1, 2 heads, 5]
    layer = LayerKV(keys=torch.zeros(2, 5, 4), values=torch.zeros(2, 5, 4), queries=torch.zeros(2, 1, 4))
    kept = KVzipPolicy(scores, sinks=1).select(layer, 3).to_mask(5)
    assert kept.tolist() == [[True, False, True, False, True], [True, True, False, True, False]]
