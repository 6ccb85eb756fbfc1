"""Loading the bundled model for the reference runner (HF transformers, CPU, float32 by default)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from vllm_kvevict.hf_reference.attention import register_attention


def load_reference_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode with the ``kvevict`` attention function, its tokenizer).

    float32 by default so that the reference is the exact math; pass ``torch.bfloat16`` to compare with a
    bf16 vLLM run at bf16 tolerance.
    """
    name = register_attention()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=name)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return model, tokenizer


def as_model(model_or_dir: PreTrainedModel | str | Path) -> PreTrainedModel:
    """A model given as itself or as a directory; a model loaded elsewhere is switched to ``kvevict``."""
    if isinstance(model_or_dir, str | Path):
        return load_reference_model(model_or_dir)[0]
    name = register_attention()
    if model_or_dir.config._attn_implementation != name:
        model_or_dir.set_attn_implementation(name)
    return model_or_dir


def attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    return [layer.self_attn for layer in model.model.layers]


def o_proj_weights(model: PreTrainedModel) -> list[torch.Tensor]:
    """[hidden, q_heads * d] o_proj weight of every layer (float32 copies), for CriticalKV."""
    return [module.o_proj.weight.detach().float().clone() for module in attention_modules(model)]


def rope_inv_freq(model: PreTrainedModel) -> torch.Tensor:
    """[d / 2] float32 RoPE inverse frequencies of ``model`` (every layer shares them), for the methods that
    take RoPE out of the post-RoPE queries (Expected Attention)."""
    rotary = model.model.rotary_emb
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise ValueError(
            "RoPE with an attention scaling (YaRN-style) is not modelled by the reference runner"
        )
    return rotary.inv_freq.detach().float().cpu().clone()
