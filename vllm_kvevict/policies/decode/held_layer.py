"""What one layer of one request holds at a decode-time re-score: the one object a decode method is given
(``DecodeEvictionPolicy.observe/scores/select``). Pure torch, no vLLM import."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeldLayer:
    """The entries each KV head of one layer holds, in slot order (position order within a head).

    positions: [kv_heads, L] int64 token positions, -1 = padding (heads hold different counts).
    keys:      [kv_heads, L, d] post-RoPE keys of those entries (anything finite at padding), or None when
               the caller read none for a method that reads none (``DecodeEvictionPolicy.reads_keys``).
    values:    [kv_heads, L, d] their values, or None likewise (``reads_values``).
    layer_idx, num_layers: where the layer sits (a learned scorer has weights per layer).
    """

    positions: torch.Tensor
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    layer_idx: int = 0
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.positions.dim() != 2:
            raise ValueError(f"positions must be [kv_heads, L]; got {tuple(self.positions.shape)}")
        for name, rows in (("keys", self.keys), ("values", self.values)):
            if rows is not None and (rows.dim() != 3 or rows.shape[:2] != self.positions.shape):
                raise ValueError(
                    f"{name} must be [kv_heads, L, d] with [kv_heads, L] = {tuple(self.positions.shape)}; "
                    f"got {tuple(rows.shape)}"
                )
        if not 0 <= self.layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={self.layer_idx} must be in [0, num_layers={self.num_layers})")

    @property
    def num_kv_heads(self) -> int:
        return self.positions.shape[0]

    @property
    def width(self) -> int:
        return self.positions.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """[kv_heads, L] bool, True at held entries (False at padding)."""
        return self.positions >= 0

    def key_rows(self, owner: str) -> torch.Tensor:
        """[kv_heads, L, d] ``keys``; ValueError naming ``owner`` when the caller read none."""
        if self.keys is None:
            raise ValueError(f"{owner} reads the held keys, but the caller read none (reads_keys)")
        return self.keys

    def value_rows(self, owner: str) -> torch.Tensor:
        """[kv_heads, L, d] ``values``; ValueError naming ``owner`` when the caller read none."""
        if self.values is None:
            raise ValueError(f"{owner} reads the held values, but the caller read none (reads_values)")
        return self.values
