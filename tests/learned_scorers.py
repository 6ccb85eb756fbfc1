"""Random-weight learned scorers for mechanics tests (never for quality claims): shaped like the layers a test
builds, or like a real model's config so the served model accepts them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vllm_kvevict.policies.base import LayerKV
from vllm_kvevict.policies.surrogate_scorer import ScorerSpec, SurrogateScorer, model_fingerprint


def random_scorer(
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    kind: str = "linear",
    seed: int = 0,
    fingerprint: dict[str, object] | None = None,
    model_name: str = "random",
) -> SurrogateScorer:
    """A scorer of ``kind`` with seeded random weights for layers of ``kv_heads`` heads of ``head_dim``."""
    fingerprint = fingerprint or {
        "architecture": "random",
        "num_hidden_layers": num_layers,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_size": kv_heads * head_dim,
        "vocab_size": 0,
    }
    hidden = 8 if kind == "mlp" else None
    spec = ScorerSpec(
        model_name, fingerprint, num_layers, kv_heads, head_dim, head_dim, kind, hidden_dim=hidden
    )
    g = torch.Generator().manual_seed(seed)
    out = hidden or kv_heads
    layers = []
    for _ in range(num_layers):
        layer = {
            "mean": torch.zeros(spec.input_dim),
            "scale": torch.ones(spec.input_dim),
            "w1": torch.randn(spec.input_dim, out, generator=g) / spec.input_dim**0.5,
            "b1": torch.zeros(out),
        }
        if kind == "mlp":
            layer["w2"] = torch.randn(out, kv_heads, generator=g)
            layer["b2"] = torch.zeros(kv_heads)
        layers.append(layer)
    return SurrogateScorer(spec, layers)


def scorer_shaped_like(layer: LayerKV) -> SurrogateScorer:
    """The random scorer of layers shaped like ``layer`` (the same one for every layer of that shape)."""
    return random_scorer(layer.num_layers, layer.num_kv_heads, layer.keys.shape[2]).to(layer.keys.device)


def write_scorer_for(hf_config: Any, directory: Path, kind: str = "linear", model_name: str = "") -> Path:
    """A random scorer matching ``hf_config``'s fingerprint (so a server of that model accepts it), saved."""
    fingerprint = model_fingerprint(hf_config)
    scorer = random_scorer(
        int(fingerprint["num_hidden_layers"]),  # type: ignore[arg-type]
        int(fingerprint["num_key_value_heads"]),  # type: ignore[arg-type]
        int(fingerprint["head_dim"]),  # type: ignore[arg-type]
        kind,
        fingerprint=fingerprint,
        model_name=model_name or str(fingerprint["architecture"]),
    )
    scorer.save(directory)
    return directory
