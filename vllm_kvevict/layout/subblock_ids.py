"""Sub-block ids of a store's rows, and the table a compacting request gets from its pool. No vLLM import.

Rows of requests still in the standard layout hold sub-blocks ``block * H + h`` of their block-table row,
so one formula serves the whole batch. Sub-blocks of a compacted request come from its pool: the sub-blocks
of blocks ``[first_block, ...)`` of its block-table row, in block then head order; ``cursor`` counts the
pool entries taken. Heads take pool entries in head order, exactly like ``SubBlockTable``.

Pooled mode (``layer_blocks`` = NB > 0, ``docs/design_modes.md``, "Per-layer block budgets"): the L layer
caches are one array of sub-blocks ``[L*NB*H, ...]``, group g is layer g and every id is global: head h of
block b of layer g is ``(g*NB + b)*H + h`` (standard rows too). A compacted request has ONE pool shared by
its layers, counted by ``pool_cursor`` [S]: entry k is layer ``(k // H) % L``, block column ``first_block +
k // (L*H)``, head slot ``k % H`` (block, then layer, then head), so a layer may hold more sub-blocks than
another and the request needs the mean over layers, not the largest. ``assign`` takes the entries from
``pool_start`` on (the request's earlier layers took the ones before); ``grow`` hands entries out by slot,
then layer, then head, exactly like ``PooledRequestSubBlocks`` in the reference model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

Index = TypeVar("Index", np.ndarray, torch.Tensor)  # pool entries on the host or the device


class SubBlockPoolExhausted(RuntimeError):
    """A head needed a new sub-block and the request had none free: the accounting rule was broken."""


@dataclass
class TableRows:
    """A request's table for one group, built at compaction and committed when every layer of the group has
    been compacted. rows [H, W] int32 sub-block ids, lengths [H] int32, cursor [] int64 pool entries taken;
    pool_start: the pool entry its first sub-block came from (pooled mode; 0 otherwise)."""

    rows: torch.Tensor
    lengths: torch.Tensor
    cursor: torch.Tensor
    pool_start: int | torch.Tensor = 0

    def token_slots(self, block_size: int, heads: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """[K] int64 one-head-view slots of token ``index[k]`` of head ``heads[k]`` (both [K] int64)."""
        return self.rows[heads, index // block_size].to(torch.int64) * block_size + index % block_size


def head_token_index(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-head counts: ([total] head of each entry, [total] its index within the head).

    counts: [H] int64 with ``counts.sum() == total`` (the caller knows ``total`` on the host: no sync)."""
    heads = torch.repeat_interleave(
        torch.arange(counts.numel(), device=counts.device), counts, output_size=total
    )
    starts = torch.cumsum(counts, 0) - counts
    return heads, torch.arange(total, device=counts.device) - starts[heads]


class SubBlockIds:
    """Where the sub-blocks of a store's rows come from (module docstring): its geometry, the pool entry
    arithmetic, and ``assign`` / ``append_tokens``, which build a compacting request's ``TableRows``."""

    def __init__(
        self, num_groups: int, num_kv_heads: int, block_size: int, width: int, device: torch.device | str,
        layer_blocks: int = 0,
    ) -> None:
        if layer_blocks < 0 or num_groups < 1:
            raise ValueError(f"layer_blocks={layer_blocks} must be >= 0 and num_groups={num_groups} >= 1")
        self.num_groups = num_groups
        self.layer_blocks = layer_blocks
        self.pooled = layer_blocks > 0
        # Pool entry k lies in block column first_block + k // span (span: sub-blocks of a block, all layers).
        self._span = num_kv_heads * (num_groups if self.pooled else 1)
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.device = torch.device(device)
        self.width = width
        self._head_ids = torch.arange(num_kv_heads, dtype=torch.int32, device=self.device)
        # [G] first global sub-block id of each layer's region (pooled mode; zeros otherwise).
        stride = layer_blocks * num_kv_heads
        self._group_base = torch.arange(num_groups, dtype=torch.int32, device=self.device) * stride
        # Power-of-two block sizes (vLLM's usual ones) divide by shifting: integer division is slow on CPU.
        self._shift = block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else None

    def _pool_entry(self, entry: Index) -> tuple[Index, Index]:
        """(block column after ``first_block``, offset) of pool entries ``entry`` (numpy or torch integers):
        the entry is sub-block ``row[first_block + column] * H + offset`` (pooled: offset = layer * NB * H +
        head slot)."""
        heads = self.num_kv_heads
        if not self.pooled:
            return entry // heads, entry % heads
        layer = (entry // heads) % self.num_groups
        return entry // self._span, layer * (self.layer_blocks * heads) + entry % heads

    def _div(self, x: torch.Tensor) -> torch.Tensor:
        return x >> self._shift if self._shift is not None else x // self.block_size

    def _mod(self, x: torch.Tensor) -> torch.Tensor:
        return x & (self.block_size - 1) if self._shift is not None else x % self.block_size

    def _cdiv(self, x: torch.Tensor) -> torch.Tensor:
        return self._div(x + (self.block_size - 1))

    def assign(
        self,
        counts: torch.Tensor,
        block_row: torch.Tensor,
        first_block: int,
        trailing: int,
        total: int,
        num_blocks: int,
        check: bool,
        shared_blocks: int = 0,
        *,
        pool_start: int | torch.Tensor = 0,
        group: int = 0,
    ) -> TableRows:
        """A request's table whose head h keeps ``counts[h]`` tokens then ``trailing`` more (tokens computed
        after the prompt in the same step), sub-blocks taken in head order from its pool — the assignment
        of ``SubBlockTable.assign`` followed by ``append(trailing)``. With ``shared_blocks`` = c, every head
        first reads the c leading blocks of its row in the standard layout (a prefix shared through vLLM's
        prefix cache: full, never part of the pool), then its own sub-blocks.

        Pooled mode: the table of layer ``group``, taking pool entries from ``pool_start`` on (int, or a []
        int64 tensor on the device to avoid a read): the entries the request's earlier layers took in this
        compaction, i.e. the sum of their tables' ``cursor``; layers are assigned in layer order. Its shared
        blocks are read in the layer's own region. Elsewhere ``pool_start`` and ``group`` must be 0.

        counts [H] int64 on the device; block_row [Wb] its block-table row; total = counts.sum() (host)."""
        if not self.pooled and not (isinstance(pool_start, int) and pool_start == 0 and group == 0):
            raise ValueError("pool_start and group are for a pooled store (layer_blocks > 0) only")
        bs, heads = self.block_size, self.num_kv_heads
        counts = counts.to(device=self.device, dtype=torch.int64)
        per_head = (counts + bs - 1) // bs
        start = pool_start + torch.cumsum(per_head, 0) - per_head  # first pool entry of each head
        columns = torch.arange(self.width, device=self.device)
        own = columns - shared_blocks  # column of each head's own sub-blocks
        entry = start[:, None] + own[None, :]  # [H, W]
        valid = (own[None, :] >= 0) & (own[None, :] < per_head[:, None])
        column_in_pool, offset = self._pool_entry(entry)
        block_col = (first_block + column_in_pool).clamp(min=0, max=block_row.numel() - 1)
        rows = block_row.to(torch.int64)[block_col] * heads + offset
        rows = torch.where(valid, rows, 0)
        if shared_blocks:
            standard = block_row.to(torch.int64)[:shared_blocks][None, :] * heads + self._head_ids[:, None]
            rows[:, :shared_blocks] = standard + group * self.layer_blocks * heads  # the layer's region
        table = TableRows(
            rows.to(torch.int32), (counts + shared_blocks * bs).to(torch.int32), per_head.sum(), pool_start
        )
        last = pool_start + table.cursor - 1  # the table's last pool entry: its block must be held
        if check and total and int(first_block + self._pool_entry(last)[0]) >= num_blocks:
            raise SubBlockPoolExhausted(
                "a compacting request's kept tokens do not fit in the blocks it keeps; "
                "the block accounting rule was broken"
            )
        if trailing:
            self.append_tokens(table, trailing, block_row, first_block, num_blocks, check)
        return table

    def append_tokens(
        self,
        table: TableRows,
        num_tokens: int,
        block_row: torch.Tensor,
        first_block: int,
        num_blocks: int,
        check: bool,
        pool_at: int | None = None,
    ) -> torch.Tensor:
        """``grow`` for one uncommitted table (trailing tokens of a recomputed request): ``num_tokens`` more
        entries per head, new sub-blocks taken in head order from the pool entries after the table's own,
        or (pooled mode) from entry ``pool_at`` on: after every layer's kept entries, so a kept context's
        blocks hold nothing else (``layout/context_reuse.py``). Returns the pool entries taken ([] on the
        device: no read)."""
        if pool_at is not None and not self.pooled:
            raise ValueError("pool_at is for a pooled store (layer_blocks > 0) only")
        bs, heads = self.block_size, self.num_kv_heads
        before = table.lengths.to(torch.int64)
        after = before + num_tokens
        used = (before + bs - 1) // bs
        need = (after + bs - 1) // bs - used
        taken = table.cursor
        base = table.pool_start + table.cursor if pool_at is None else pool_at
        pool = base + torch.cumsum(need, 0) - need
        for k in range(-(-num_tokens // bs)):
            column_in_pool, offset = self._pool_entry(pool + k)
            block_col = first_block + column_in_pool
            if check and bool(((need > k) & (block_col >= num_blocks)).any()):
                raise SubBlockPoolExhausted(
                    "trailing tokens of a compacting request do not fit in its blocks; "
                    "the block accounting rule was broken"
                )
            subblock = block_row.to(torch.int64)[block_col.clamp(max=block_row.numel() - 1)] * heads + offset
            target = (used + k).clamp(max=self.width - 1)[:, None]
            current = table.rows.gather(1, target)[:, 0]
            table.rows.scatter_(1, target, torch.where(need > k, subblock, current).to(torch.int32)[:, None])
        table.cursor = table.cursor + need.sum()
        table.lengths = after.to(torch.int32)
        return table.cursor - taken

