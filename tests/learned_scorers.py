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
    per_head: bool = True,
) -> SurrogateScorer:
    """A scorer of ``kind`` with seeded random weights for layers of ``kv_heads`` heads of ``head_dim``.
    per_head: block-diagonal weights, each head scored from its own features alone (what per-chunk eviction
    needs, ``scores_each_head_alone``); False: every head's score reads every head's features."""
    fingerprint = fingerprint or {
        "architecture": "random",
        "num_hidden_layers": num_layers,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_size": kv_heads * head_dim,
        "vocab_size": 0,
    }
    units = 4  # hidden units per head of an MLP
    hidden = units * kv_heads if kind == "mlp" else None
    spec = ScorerSpec(
        model_name, fingerprint, num_layers, kv_heads, head_dim, head_dim, kind, hidden_dim=hidden
    )
    g = torch.Generator().manual_seed(seed)
    out = hidden or kv_heads
    per_head_features = spec.input_dim // kv_heads
    reads = torch.ones(spec.input_dim, out)
    feeds = torch.ones(out, kv_heads)
    if per_head:
        owner = torch.arange(out) // (units if kind == "mlp" else 1)  # the head each unit belongs to
        reads = (torch.arange(spec.input_dim)[:, None] // per_head_features == owner[None]).float()
        feeds = (owner[:, None] == torch.arange(kv_heads)[None]).float()
    layers = []
    for _ in range(num_layers):
        layer = {
            "mean": torch.zeros(spec.input_dim),
            "scale": torch.ones(spec.input_dim),
            "w1": torch.randn(spec.input_dim, out, generator=g) / per_head_features**0.5 * reads,
            "b1": torch.zeros(out),
        }
        if kind == "mlp":
            layer["w2"] = torch.randn(out, kv_heads, generator=g) * feeds
            layer["b2"] = torch.zeros(kv_heads)
        layers.append(layer)
    return SurrogateScorer(spec, layers)


def scorer_shaped_like(layer: LayerKV) -> SurrogateScorer:
    """The random scorer of layers shaped like ``layer`` (the same one for every layer of that shape)."""
    return random_scorer(layer.num_layers, layer.num_kv_heads, layer.keys.shape[2]).to(layer.keys.device)


def write_scorer_for(
    hf_config: Any, directory: Path, kind: str = "linear", model_name: str = "", per_head: bool = True
) -> Path:
    """A random scorer matching ``hf_config``'s fingerprint (so a server of that model accepts it), saved."""
    fingerprint = model_fingerprint(hf_config)
    scorer = random_scorer(
        int(fingerprint["num_hidden_layers"]),  # type: ignore[arg-type]
        int(fingerprint["num_key_value_heads"]),  # type: ignore[arg-type]
        int(fingerprint["head_dim"]),  # type: ignore[arg-type]
        kind,
        fingerprint=fingerprint,
        model_name=model_name or str(fingerprint["architecture"]),
        per_head=per_head,
    )
    scorer.save(directory)
    return directory
