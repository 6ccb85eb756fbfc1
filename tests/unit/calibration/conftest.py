"""A tiny random-weight Llama with the bundled model's tokenizer (its chat template and vocabulary)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    """2 layers, 4 query heads over 2 KV heads of 8 dims, hidden 32; float32, sdpa, eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger than the default init, so attention is far from uniform
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def tiny_model(tokenizer) -> LlamaForCausalLM:
    return tiny_llama(len(tokenizer))


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_model, tokenizer, tmp_path_factory) -> Path:
    """The tiny model and the bundled tokenizer saved as an HF directory."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory
