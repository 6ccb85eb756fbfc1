"""Held entries read back from one layer's cache, with the rows of a shared prefix read once.

Requests on one shared prefix that are re-scored in the same step (vLLM schedules several prefix hits per
step) each read what they hold, the shared prefix first. Its rows are the same cache rows for all of them
and nothing writes them during the layer's re-scores (shared blocks are never written, and the layer's moves
are made after every request was scored), so the first reader's rows serve the others, who read only their
own entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.datapath.moves import CacheRows


@dataclass(frozen=True)
class PrefixRows:
    """A shared prefix read once: its slots [H, S] and keys/values [H, S, D] (values None: keys only)."""

    slots: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor | None


class HeldReads:
    """Reads of held entries [H, L] through one layer's ``CacheRows`` for one step, reusing the rows of a
    shared prefix (the first ``shared`` entries of each head) another request of the step read already."""

    def __init__(self, rows: CacheRows) -> None:
        self.rows = rows
        self._prefixes: list[PrefixRows] = []

    def read(
        self, slots: torch.Tensor, shared: int, with_values: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(keys [H, L, D], values [H, L, D] or None) at ``slots`` [H, L] int64, whose first ``shared``
        entries per head are a shared prefix."""
        length = slots.shape[1]
        shared = min(shared, length)
        prefix = self._find(slots[:, :shared], with_values) if shared else None
        if prefix is None:
            keys, values = self._read(slots, with_values)
            if shared:
                self._prefixes.append(
                    PrefixRows(
                        slots[:, :shared],
                        keys[:, :shared],
                        None if values is None else values[:, :shared],
                    )
                )
            return keys, values
        if shared == length:
            return prefix.keys, prefix.values if with_values else None
        own_keys, own_values = self._read(slots[:, shared:], with_values)
        keys = torch.cat([prefix.keys, own_keys], dim=1)
        if not with_values:
            return keys, None
        assert prefix.values is not None and own_values is not None
        return keys, torch.cat([prefix.values, own_values], dim=1)

    def _find(self, prefix_slots: torch.Tensor, with_values: bool) -> PrefixRows | None:
        """The prefix read earlier at exactly these slots (with values where they are needed)."""
        for prefix in self._prefixes:
            if (
                prefix.slots.shape == prefix_slots.shape
                and (prefix.values is not None or not with_values)
                and torch.equal(prefix.slots, prefix_slots)
            ):
                return prefix
        return None

    def _read(self, slots: torch.Tensor, with_values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        heads, length = slots.shape
        if not with_values:
            return self.rows.read_keys(slots).view(heads, length, -1), None
        keys, values = self.rows.read(slots)
        return keys.view(heads, length, -1), values.view(heads, length, -1)
