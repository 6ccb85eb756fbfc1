"""Random layers for the policy tests (imported by the tests and by conftest's fixtures)."""

from __future__ import annotations

import torch

from vllm_kvevict.policies.base import LayerKV


def random_layer(
    kv_heads: int = 2,
    group: int = 3,
    n: int = 50,
    w: int | None = None,
    d: int = 16,
    hidden: int = 24,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    layer_idx: int = 0,
    num_layers: int = 4,
) -> LayerKV:
    """A layer with random keys/values/o_proj and the last ``w`` (default: all n) queries."""
    g = torch.Generator().manual_seed(seed)
    w = n if w is None else w
    q_heads = kv_heads * group

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return LayerKV(
        keys=rand(kv_heads, n, d) * 2,
        values=rand(kv_heads, n, d),
        queries=rand(q_heads, w, d) * 2,
        layer_idx=layer_idx,
        num_layers=num_layers,
        o_proj=rand(hidden, q_heads * d),
    )
