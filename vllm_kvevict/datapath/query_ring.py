"""Recent queries of requests with a decode-time cap, kept per layer in one ring tensor (not attention
matrices), and the step's batched writes into it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class QueryRing:
    """Recent queries of capped requests by ring row: ``queries [L, rows, R, Hq, D]`` and their positions
    ``positions [rows, R]`` int64 (-1: empty); query at position p sits at ring index p % R."""

    def __init__(self, num_layers: int, window: int) -> None:
        self.num_layers = num_layers
        self.window = window
        self.queries: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self._free: list[int] = []
        self._rows = 0

    def take_row(self) -> int:
        if self._free:
            return self._free.pop()
        self._rows += 1
        return self._rows - 1

    def release(self, row: int) -> None:
        if self.positions is not None and row < self.positions.shape[0]:
            self.positions[row] = -1
        self._free.append(row)

    def ensure(self, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Room for every row taken so far (grows by doubling)."""
        have = 0 if self.positions is None else self.positions.shape[0]
        if self._rows <= have and self.queries is not None and self.queries.dtype == dtype:
            return
        rows = max(self._rows, 2 * have, 1)
        queries = torch.zeros(self.num_layers, rows, self.window, heads, dim, dtype=dtype, device=device)
        positions = torch.full((rows, self.window), -1, dtype=torch.int64, device=device)
        if self.positions is not None and self.queries is not None:
            queries[:, :have] = self.queries.to(dtype)
            positions[:have] = self.positions
        self.queries, self.positions = queries, positions

    def read(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([Hq, R, D] queries, [R] positions) of one request's ring for ``layer``."""
        assert self.queries is not None and self.positions is not None
        return self.queries[layer, row].transpose(0, 1), self.positions[row]

    def read_recent(self, layer: int, row: int, newest: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([Hq, count, D], [count]) the queries at positions newest - count + 1 .. newest (count <= R)."""
        assert self.queries is not None and self.positions is not None
        device = self.positions.device
        index = torch.arange(newest - count + 1, newest + 1, device=device) % self.window
        return self.queries[layer, row, index].transpose(0, 1), self.positions[row, index]


@dataclass(frozen=True)
class RingWrites:
    """This step's queries to keep: token rows ``tokens`` [n] of the step's query go to ring ``rows`` [n]
    at ``index`` [n] (position % R); built once per step, used by every layer."""

    tokens: torch.Tensor
    rows: torch.Tensor
    index: torch.Tensor
