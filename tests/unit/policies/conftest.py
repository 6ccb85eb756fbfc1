"""Shared builders for the policy tests: random layers of any shape, and fixed-score scorers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from vllm_kvevict.policies.base import LayerKV, ScoredPolicy


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


@pytest.fixture
def make_layer() -> Callable[..., LayerKV]:
    return random_layer


@dataclass
class FixedScores(ScoredPolicy):
    """A scorer returning given scores: lets selection be checked by hand, without attention."""

    scores: torch.Tensor
    window: int = 0

    @property
    def min_budget(self) -> int:
        return self.window

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        return self.scores.clone()


@pytest.fixture
def fixed_scores() -> type[FixedScores]:
    return FixedScores
