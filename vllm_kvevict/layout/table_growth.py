"""Room for one step's tokens in every row of a store at once. No vLLM import.

One decode step updates every row of every group with a few batched ops (``grow``), whatever the batch size,
layer or head count: on CPU through numpy views of the few rows that need a sub-block, elsewhere densely
over every row with no device read.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_kvevict.layout.head_mirror import HeadMirror
from vllm_kvevict.layout.subblock_ids import SubBlockIds, SubBlockPoolExhausted


class TableGrowth(SubBlockIds):
    """``grow`` of ``SubBlockStore``, over the store's tensors (shapes in ``SubBlockStore``)."""

    tables: torch.Tensor
    lengths: torch.Tensor
    cursor: torch.Tensor
    tail: torch.Tensor
    first_block: torch.Tensor
    pool_cursor: torch.Tensor
    capacity: int
    _mirror: HeadMirror

    def grow(
        self, num_slots: int, q_lens: torch.Tensor, growing: torch.Tensor, compacted: torch.Tensor,
        block_table: torch.Tensor, num_blocks: torch.Tensor, max_new_subblocks: int, check: bool,
        single_token: bool = False,
    ) -> None:
        """Room for this step's tokens in every group at once.

        q_lens [R] int tokens of each slot this step; growing [R] bool rows to grow (others untouched);
        compacted [R] bool rows drawing from their pool (others: standard rows, next block-table column);
        block_table [R, Wb] vLLM's rows; num_blocks [R] blocks each request holds after this step;
        max_new_subblocks: host bound on new sub-blocks per head (``cdiv(max q_len, block_size)``);
        single_token: no growing row takes more than one token (decode), a cheaper test of who needs one.
        check: the CPU path (tensors on the CPU): only rows that need a sub-block are touched (found with
        ``nonzero``, which would synchronise a GPU) and a dry pool raises ``SubBlockPoolExhausted``; without
        it every row is updated densely, with no device read. Pooled mode: a request's rows take entries of
        its one pool by group (layer), then head, each row its new sub-blocks one after the other.
        """
        lengths = self.lengths[:, :num_slots]  # [G, R, H]
        added = (q_lens * growing).to(torch.int32)[None, :, None]
        if single_token and self._shift is not None:
            # At most one new sub-block per row: exactly the rows that grow from a full last sub-block.
            need = ((lengths & (self.block_size - 1)) == 0) & (added > 0)
        else:
            need = self._cdiv(lengths + added) - self._cdiv(lengths)  # new sub-blocks per row
        if max_new_subblocks:
            update = self._assign_sparse if check else self._assign_dense
            update(num_slots, need, compacted, block_table, num_blocks, max_new_subblocks)
        lengths += added

    def _assign_sparse(
        self, num_slots: int, need: torch.Tensor, compacted: torch.Tensor, block_table: torch.Tensor,
        num_blocks: torch.Tensor, max_new: int,
    ) -> None:
        """``grow``'s assignment for the few rows that need a sub-block, on CPU: numpy views of the same
        memory, because each torch call costs microseconds of dispatch and this runs dozens of small ones."""
        heads, capacity = self.num_kv_heads, self.capacity
        if self.pooled:  # one pool per request: rows in slot, then group (layer), then head order
            need_np = need.numpy().transpose(1, 0, 2).reshape(-1)
            flat = np.flatnonzero(need_np)
            slot, rest = np.divmod(flat, self.num_groups * heads)
            group, head = np.divmod(rest, heads)
            row = slot * heads + head
            request, request_cell, cursor = slot, slot, self.pool_cursor.numpy()
        else:
            need_np = need.numpy().reshape(-1)
            flat = np.flatnonzero(need_np)  # ascending: by group, then slot, then head
            group, row = np.divmod(flat, num_slots * heads)
            slot, head = np.divmod(row, heads)
            request, request_cell = flat // heads, group * capacity + slot
            cursor = self.cursor.numpy().reshape(-1)
        if not len(flat):
            return
        count = need_np[flat].astype(np.int64)
        cell = group * capacity * heads + row  # flat index into lengths / tail
        used = -(-self.lengths.numpy().reshape(-1)[cell].astype(np.int64) // self.block_size)
        # Rows of a request take pool entries in order: offset = needs of its earlier rows.
        taken = np.cumsum(count)
        run_start = np.ones(len(flat), dtype=bool)
        run_start[1:] = request[1:] != request[:-1]
        before_run = np.maximum.accumulate(np.where(run_start, taken - count, 0))
        pool = cursor[request_cell].astype(np.int64) + taken - count - before_run
        is_pool = compacted.numpy()[slot]
        starts = np.flatnonzero(run_start)  # one run per request: add its entries to its cursor
        cursor[request_cell[starts]] += np.add.reduceat(count * is_pool, starts).astype(cursor.dtype)
        own = head  # a standard row's head slot (plus its layer's region in pooled mode)
        if self.pooled:
            np.add.at(self.cursor.numpy().reshape(-1), group * capacity + slot, count * is_pool)
            own = head + group * (self.layer_blocks * heads)
        first = self.first_block.numpy()[slot].astype(np.int64)
        rows = block_table.numpy()
        blocks_held = num_blocks.numpy()[slot]
        tables, tail = self.tables.numpy().reshape(-1), self.tail.numpy().reshape(-1)
        for k in range(max_new):
            if k:
                keep = count > k
                group, slot, head, own, count, used, pool, is_pool, first, cell, blocks_held = (
                    a[keep]
                    for a in (group, slot, head, own, count, used, pool, is_pool, first, cell, blocks_held)
                )
            column_in_pool, offset = self._pool_entry(pool + k)
            column = np.where(is_pool, first + column_in_pool, used + k)
            if (is_pool & (column >= blocks_held)).any():
                raise SubBlockPoolExhausted(
                    "a compacted request needs a sub-block and has none free; the block accounting rule was "
                    "broken"
                )
            block = rows[slot, np.minimum(column, rows.shape[1] - 1)].astype(np.int64)
            subblock = block * heads + np.where(is_pool, offset, own)
            column = np.minimum(used + k, self.width - 1)
            tables[cell * self.width + column] = subblock
            tail[cell] = subblock
            self._mirror.write_cells(num_slots, heads, group, head, slot, column, subblock)

    def _assign_dense(
        self, num_slots: int, need: torch.Tensor, compacted: torch.Tensor, block_table: torch.Tensor,
        num_blocks: torch.Tensor, max_new: int,
    ) -> None:
        """``grow``'s assignment over every row, with no device read (GPU)."""
        heads = self.num_kv_heads
        self._mirror.drop()  # written everywhere: the head-major copy is rebuilt
        need = need.to(torch.int32)
        used = self._cdiv(self.lengths[:, :num_slots])
        own = self._head_ids[None, None, :]
        if self.pooled:  # entries before a row: its request's earlier rows in slot, group, head order
            order = need.transpose(0, 1).reshape(num_slots, -1)  # [R, G*H]
            before = torch.cumsum(order, 1, dtype=torch.int32) - order
            before = before.view(num_slots, -1, heads).transpose(0, 1)
            pool = self.pool_cursor[None, :num_slots, None] + before
            self.pool_cursor[:num_slots] += need.sum((0, 2), dtype=torch.int32) * compacted
            own = own + self._group_base[:, None, None]
        else:
            pool = self.cursor[:, :num_slots, None] + torch.cumsum(need, 2, dtype=torch.int32) - need
        self.cursor[:, :num_slots] += need.sum(2, dtype=torch.int32) * compacted[None, :]
        tables = self.tables[:, :num_slots]
        tail = self.tail[:, :num_slots]
        rows = block_table[None].expand(self.num_groups, -1, -1)  # [G, R, Wb]
        first = self.first_block[None, :num_slots, None]
        is_pool = compacted[None, :, None]
        for k in range(max_new):
            column_in_pool, offset = self._pool_entry(pool + k)
            column = torch.where(is_pool, first + column_in_pool, used + k).clamp(0, rows.shape[2] - 1)
            subblock = torch.gather(rows, 2, column.to(torch.int64)).to(torch.int32) * heads + torch.where(
                is_pool, offset, own
            )
            subblock = torch.where(need > k, subblock, -1)
            target = (used + k).clamp(max=self.width - 1).to(torch.int64)[..., None]
            current = tables.gather(3, target)[..., 0]
            tables.scatter_(3, target, torch.where(subblock >= 0, subblock, current)[..., None])
            tail.copy_(torch.where(subblock >= 0, subblock, tail))
