"""The head-major copy of a store's sub-block tables that the attention kernels read. No vLLM import."""

from __future__ import annotations

import numpy as np
import torch


def host_index(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """[N] int64 index tensor on ``device`` from host values."""
    index = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    return index if device.type == "cpu" else index.to(device)


class HeadMirror:
    """The head-major copy of ``SubBlockStore.tables`` the kernels read, kept between steps.

    table: [G, H, R, Wm] int32 (viewed [G, H*R, Wm]): row ``(g, h, r)`` holds columns ``[0, Wm)`` of
    ``tables[g, r, h]``; columns past a head's length are never read. It is valid for one batch size R; the
    store marks what it writes since the last ``block_tables`` (whole (group, slot) rows in ``dirty``, or
    single cells written straight through by ``write_cells``) or drops the mirror (``drop``) when a write
    is not tracked (a reallocation, a group split, the dense GPU growth).
    """

    def __init__(self) -> None:
        self.table: torch.Tensor | None = None
        self.dirty = np.zeros((0, 0), dtype=bool)  # [G, S] rows to copy again

    def drop(self) -> None:
        self.table = None

    def mark(self, groups: np.ndarray | slice, slots: np.ndarray) -> None:
        """Rows (groups, slots) changed: ``groups`` a slice (all) or an array paired with ``slots``."""
        if self.table is not None:
            self.dirty[groups, slots] = True

    def mark_slots(self, slots: torch.Tensor) -> None:
        """Every group's rows of ``slots`` [n] changed (read on the host only on CPU: elsewhere the mirror is
        rebuilt, which needs no device read)."""
        if slots.device.type == "cpu":
            self.mark(slice(None), slots.numpy())
        else:
            self.drop()

    def refresh(self, tables: torch.Tensor, num_slots: int, width: int) -> torch.Tensor:
        """[G, H, num_slots, Wm] the mirror of ``tables`` [G, S, H, W] for ``num_slots`` slots, Wm >= width:
        rebuilt whole (with room to grow) for another batch size, a wider table or after a ``drop``,
        otherwise patched where rows were marked."""
        table = self.table
        if table is None or table.shape[2] != num_slots or table.shape[3] < width:
            # Room to grow: a decode batch needs one more column every block_size steps.
            room = width if table is None or table.shape[3] < width else table.shape[3]
            room = min(tables.shape[3], max(room, width + 2 * (width // 8) + 1))
            self.table = tables[:, :num_slots, :, :room].transpose(1, 2).contiguous()
            self.dirty = np.zeros(tables.shape[:2], dtype=bool)
        else:
            rows = np.flatnonzero(self.dirty[:, :num_slots])
            if len(rows):
                group, slot = (host_index(a, tables.device) for a in np.divmod(rows, num_slots))
                table[group, :, slot] = tables[group, slot, :, : table.shape[3]]
                self.dirty[:] = False
        return self.table

    def write_cells(
        self, num_slots: int, num_kv_heads: int, group: np.ndarray, head: np.ndarray, slot: np.ndarray,
        column: np.ndarray, subblock: np.ndarray,
    ) -> None:
        """Write cells ``tables[group, slot, head, column] = subblock`` ([n] host arrays) into the mirror
        too (columns it does not hold are never read from it)."""
        table = self.table
        if table is None:
            return
        if table.shape[2] != num_slots:
            self.drop()
            return
        room = table.shape[3]
        held = column < room
        flat = ((group * num_kv_heads + head) * num_slots + slot) * room + column
        table.numpy().reshape(-1)[flat[held]] = subblock[held]
