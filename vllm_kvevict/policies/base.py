"""The contract every eviction policy fulfils. Pure torch, no vLLM import.

A policy sees one attention layer of one request at a time and answers: which prompt tokens does each KV
head keep? The caller (the vLLM adapter, the kvpress parity tests, the HF quality report) owns memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKV:
    """One layer's prompt cache and the queries that judge it.

    keys:    [kv_heads, n, d] post-RoPE keys of the n prompt tokens.
    values:  [kv_heads, n, d] values of the same tokens.
    queries: [q_heads, w, d] post-RoPE queries of the observation window (the last w prompt positions) or
             of proxy tokens; q_heads is a multiple of kv_heads (GQA group = q_heads // kv_heads, query head
             j belongs to KV head j // group).
    query_positions: [w] token positions (0-based, < n) of those queries, for the causal mask; None means
             the last w positions n-w .. n-1.
    layer_idx, num_layers: where this layer sits (PyramidKV budgets, per-layer seeds).
    o_proj: [hidden, q_heads * d] this layer's o_proj weight (CriticalKV), or None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    layer_idx: int = 0
    num_layers: int = 1
    query_positions: torch.Tensor | None = None
    o_proj: torch.Tensor | None = None

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    @property
    def group_size(self) -> int:
        return self.queries.shape[0] // self.keys.shape[0]


@dataclass(frozen=True)
class KeptTokens:
    """Per-KV-head kept token indices.

    indices: [kv_heads, max_kept] int64, each row sorted ascending and unique in its first counts[h]
             entries, padded with -1 after them.
    counts:  [kv_heads] int64, B_h; counts.sum() equals kv_heads * the layer budget exactly.
    """

    indices: torch.Tensor
    counts: torch.Tensor

    def head(self, h: int) -> torch.Tensor:
        """[B_h] sorted kept indices of KV head h."""
        return self.indices[h, : int(self.counts[h])]

    @property
    def total(self) -> int:
        return int(self.counts.sum())


class EvictionPolicy(ABC):
    """Chooses kept tokens per KV head for one layer.

    Budgets are per-head averages in tokens: a layer with H KV heads keeps exactly H * layer_budget tokens,
    split across heads as the policy likes (uniform methods keep layer_budget per head).
    """

    #: short user-facing name, e.g. "ada-snapkv"; set by the registry.
    name: str = ""

    def layer_budget(self, budget: int, num_tokens: int, layer_idx: int, num_layers: int) -> int:
        """Average kept tokens per head for this layer given the request's average ``budget``.

        Uniform by default; PyramidKV overrides it. Deterministic: the scheduler-side block accounting
        calls it without seeing any tensor.
        """
        return min(budget, num_tokens)

    @abstractmethod
    def select(self, layer: LayerKV, budget: int) -> KeptTokens:
        """Kept tokens of every KV head of ``layer`` for the per-head average ``budget`` of this layer
        (already passed through ``layer_budget``). Must keep exactly ``num_kv_heads * budget`` tokens."""
