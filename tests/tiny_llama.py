"""A tiny random-weight Llama on the project's masked attention (``hf_reference.attention``), for the HF
reference's mechanics tests (not quality)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_kvevict.hf_reference.attention import register_attention


def tiny_llama(num_layers: int, kv_heads: int, head_dim: int, seed: int = 0) -> LlamaForCausalLM:
    """A seeded Llama of ``num_layers`` layers, ``kv_heads`` KV heads of ``head_dim`` (4 query heads, a
    256-token vocabulary), in eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
    )
    config._attn_implementation = register_attention()
    return LlamaForCausalLM(config).eval()
