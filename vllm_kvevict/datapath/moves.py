"""What a layer's eviction asks of its cache: the one moves type, and the cache-rows interface a backend
implements to read and move rows of its own cache layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Moves:
    """Rows to move inside one layer's cache, from one-head-view slot ``src_slots[k]`` to ``slots[k]``
    ([N] int64 each; sources and destinations may overlap: gather all, then scatter).

    ``tokens``/``heads`` [N] int64 (whole-prompt eviction only): the same entries as rows
    ``key[tokens, heads]`` of the step's tensors, for a cache whose rows cannot be moved in place (a packing
    the row views cannot express; an fp8 cache's rows are moved as bytes like any other): the backend then
    writes them from the step's tensors.
    """

    src_slots: torch.Tensor
    slots: torch.Tensor
    tokens: torch.Tensor | None = None
    heads: torch.Tensor | None = None

    @staticmethod
    def join(parts: list[Moves]) -> Moves | None:
        """One ``Moves`` of several requests' moves of the same layer (None when there are none)."""
        if not parts:
            return None
        with_tokens = all(p.tokens is not None and p.heads is not None for p in parts)
        return Moves(
            torch.cat([p.src_slots for p in parts]),
            torch.cat([p.slots for p in parts]),
            torch.cat([p.tokens for p in parts]) if with_tokens else None,  # type: ignore[misc]
            torch.cat([p.heads for p in parts]) if with_tokens else None,  # type: ignore[misc]
        )


class CacheRows(Protocol):
    """One layer's cache as the datapath sees it (a backend's object, built per layer and step)."""

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [N, D], values [N, D]) at one-head-view ``slots`` int64, [N] or [H, L] (each row a head's
        held entries, which a backend may read a sub-block at a time); N = ``slots.numel()``."""
        ...

    def read_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """keys [N, D] at one-head-view ``slots`` int64, [N] or [H, L] (as ``read``)."""
        ...

    def move(self, moves: Moves) -> None:
        """Make ``moves`` inside the cache (every source read before any destination is written)."""
        ...
