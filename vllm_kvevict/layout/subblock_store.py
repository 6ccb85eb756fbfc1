"""Per-head sub-block tables of the running batch as persistent integer tensors on the cache's device.

The same tables as ``tests/unit/layout/subblock_reference.py`` (the plain model they are tested against),
laid out for the attention kernels: row ``(slot, head)`` of group ``g`` is the sub-block table of KV head
``head`` of the request in batch slot ``slot`` (vLLM's persistent input-batch order) for the layers of
group ``g``. The kernels read head-major tables (sequence ``h * R + r``, ``block_tables`` says why): a
mirror of ``tables`` in that order is kept and patched where the tables changed (``HeadMajorMirror``), so a
steady decode step copies only the cells it wrote, not every group's tables (32 groups for Ada-KV). One
decode step updates every row of every group with a few batched ops (``grow``), whatever the batch size,
layer or head count.

Rows of requests still in the standard layout hold sub-blocks ``block * H + h`` of their block-table row,
so one formula serves the whole batch. Sub-blocks of a compacted request come from its pool: the sub-blocks
of blocks ``[first_block, ...)`` of its block-table row, in block then head order; ``cursor`` counts the
pool entries taken. Heads take pool entries in head order, exactly like ``SubBlockTable``.

Groups: layers whose heads keep equal counts can share one group (SnapKV-like policies: one group for all
layers); otherwise each layer is its own group (Ada-KV). No vLLM import.

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

import numpy as np
import torch


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


def host_index(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """[N] int64 index tensor on ``device`` from host values."""
    index = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    return index if device.type == "cpu" else index.to(device)


def head_token_index(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-head counts: ([total] head of each entry, [total] its index within the head).

    counts: [H] int64 with ``counts.sum() == total`` (the caller knows ``total`` on the host: no sync)."""
    heads = torch.repeat_interleave(
        torch.arange(counts.numel(), device=counts.device), counts, output_size=total
    )
    starts = torch.cumsum(counts, 0) - counts
    return heads, torch.arange(total, device=counts.device) - starts[heads]


class HeadMirror:
    """The head-major copy of ``SubBlockStore.tables`` the kernels read, kept between steps.

    table: [G, H, R, Wm] int32 (viewed [G, H*R, Wm]): row ``(g, h, r)`` holds columns ``[0, Wm)`` of
    ``tables[g, r, h]``; columns past a head's length are never read. It is valid for one batch size R; the
    store marks what it writes since the last ``block_tables`` (whole (group, slot) rows in ``dirty``, or
    single cells written straight through by ``write_cells``) or drops the mirror (``stale``) when a write is
    not tracked (a reallocation, a group split, the dense GPU growth).
    """

    def __init__(self) -> None:
        self.table: torch.Tensor | None = None
        self.dirty = np.zeros((0, 0), dtype=bool)  # [G, S] rows to copy again

    @property
    def stale(self) -> bool:
        return self.table is None

    def drop(self) -> None:
        self.table = None

    def mark(self, groups: np.ndarray | slice, slots: np.ndarray) -> None:
        """Rows (groups, slots) changed: ``groups`` a slice (all) or an array paired with ``slots``."""
        if self.table is not None:
            self.dirty[groups, slots] = True


class SubBlockStore:
    """Sub-block tables and lengths of every (group, batch slot, KV head).

    tables:      [G, S, H, W] int32 sub-block ids (W = vLLM's block-table width: a head never holds more
                 tokens than its request, so never more sub-blocks than the request has blocks).
    lengths:     [G, S, H] int32 tokens held by each head.
    cursor:      [G, S] int32 pool entries taken by each compacted request's table.
    first_block: [S] int32 first kept block of each compacted request (blocks before it were freed).
    tail:        [G, S, H] int32 each head's last used sub-block: a decode token's slot is read from it
                 without gathering rows of the (large, randomly accessed) tables.
    pool_cursor: [S] int32 pooled mode only (``layer_blocks`` > 0, one group per layer): pool entries taken
                 by each compacted request over all its layers (``cursor`` then counts each layer's share).
    """

    def __init__(
        self,
        num_groups: int,
        num_kv_heads: int,
        block_size: int,
        width: int,
        capacity: int,
        device: torch.device | str,
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
        self.capacity = 0
        shape = (num_groups, 0, num_kv_heads)
        self.tables = torch.zeros((*shape, width), dtype=torch.int32, device=self.device)
        self.lengths = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.cursor = torch.zeros(shape[:2], dtype=torch.int32, device=self.device)
        self.tail = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.first_block = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.pool_cursor = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._head_ids = torch.arange(num_kv_heads, dtype=torch.int32, device=self.device)
        # [G] first global sub-block id of each layer's region (pooled mode; zeros otherwise).
        stride = layer_blocks * num_kv_heads
        self._group_base = torch.arange(num_groups, dtype=torch.int32, device=self.device) * stride
        # Power-of-two block sizes (vLLM's usual ones) divide by shifting: integer division is slow on CPU.
        self._shift = block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else None
        self._row_base = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._mirror = HeadMirror()
        self.ensure_capacity(capacity, width)

    # ----- allocation (rare: start-up, a larger batch, a wider block table) --------------------------------
    def ensure_capacity(self, num_slots: int, width: int) -> None:
        """Room for ``num_slots`` batch slots and ``width`` sub-blocks per head (grows by doubling)."""
        if num_slots <= self.capacity and width <= self.width:
            return
        capacity = max(num_slots, 2 * self.capacity if num_slots > self.capacity else self.capacity, 1)
        width = max(width, self.width)
        tables = torch.zeros(
            (self.num_groups, capacity, self.num_kv_heads, width), dtype=torch.int32, device=self.device
        )
        tables[:, : self.capacity, :, : self.width] = self.tables
        lengths = torch.zeros(
            (self.num_groups, capacity, self.num_kv_heads), dtype=torch.int32, device=self.device
        )
        lengths[:, : self.capacity] = self.lengths
        tail = torch.zeros_like(lengths)
        tail[:, : self.capacity] = self.tail
        cursor = torch.zeros((self.num_groups, capacity), dtype=torch.int32, device=self.device)
        cursor[:, : self.capacity] = self.cursor
        first = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        first[: self.capacity] = self.first_block
        pool_cursor = torch.zeros(capacity if self.pooled else 0, dtype=torch.int32, device=self.device)
        pool_cursor[: len(self.pool_cursor)] = self.pool_cursor
        self.tables, self.lengths, self.cursor, self.first_block = tables, lengths, cursor, first
        self.pool_cursor = pool_cursor
        self.tail = tail
        self.capacity, self.width = capacity, width
        # Flat index of (slot, head, sub-block 0) inside one group's tables, for gathers.
        rows = torch.arange(capacity * self.num_kv_heads, dtype=torch.int64, device=self.device) * width
        self._row_base = rows.view(1, capacity, self.num_kv_heads)
        self._mirror.drop()

    def split_groups(self, num_groups: int) -> None:
        """From one group shared by every layer to ``num_groups`` (one per layer), each a copy of it."""
        if self.pooled:
            raise ValueError("a pooled store has one group per layer: its groups are never split")
        if self.num_groups == num_groups:
            return
        if self.num_groups != 1:
            raise ValueError(f"can only split one shared group, the store has {self.num_groups}")
        self.tables = self.tables.repeat(num_groups, 1, 1, 1)
        self.lengths = self.lengths.repeat(num_groups, 1, 1)
        self.cursor = self.cursor.repeat(num_groups, 1)
        self.tail = self.tail.repeat(num_groups, 1, 1)
        self.num_groups = num_groups
        self._mirror.drop()

    # ----- views for the kernels --------------------------------------------------------------------------
    def block_tables(self, num_slots: int, max_len: int) -> torch.Tensor:
        """[G, H * num_slots, Wm] int32, Wm >= cdiv(max_len, bs) (the columns a head of at most ``max_len``
        tokens uses; later ones are not read): sequence ``h * num_slots + slot`` of group g is head h of the
        request in ``slot``. Head-major, so that requests reading one shared prefix read its head-h
        sub-blocks one after the other: with the caches cold (a layer after the rest of the model ran),
        request-major sequences made 16 decodes on one 2,976-token prefix 1.33x slower than vLLM's layout,
        head-major ones 0.97-0.99x (``benchmarks/attention_layouts.py --shared-prefix 2976 --cold 256``).

        The result is the store's mirror (``HeadMirror``), valid until the tables next change and this is
        called again: rebuilt whole only when the batch size changes, a wider table is needed or a write was
        not tracked; otherwise only the rows and cells written since the last call are copied. Copying every
        group's tables each step cost 23 ms per Ada-SnapKV decode step at batch 256 (32 groups)."""
        width = max(1, min(self.width, -(-max_len // self.block_size)))
        mirror, heads = self._mirror, self.num_kv_heads
        table = mirror.table
        if table is None or table.shape[2] != num_slots or table.shape[3] < width:
            # Room to grow: a decode batch needs one more column every block_size steps.
            room = width if table is None or table.shape[3] < width else table.shape[3]
            room = min(self.width, max(room, width + 2 * (width // 8) + 1))
            mirror.table = self.tables[:, :num_slots, :, :room].transpose(1, 2).contiguous()
            mirror.dirty = np.zeros((self.num_groups, self.capacity), dtype=bool)
        else:
            rows = np.flatnonzero(mirror.dirty[:, :num_slots])
            if len(rows):
                group, slot = (host_index(a, self.device) for a in np.divmod(rows, num_slots))
                table[group, :, slot] = self.tables[group, slot, :, : table.shape[3]]
                mirror.dirty[:] = False
        return mirror.table.view(self.num_groups, heads * num_slots, mirror.table.shape[3])

    def all_seq_lens(self, num_slots: int) -> torch.Tensor:
        """[G, H * num_slots] int32 head lengths in ``block_tables``' sequence order (a copy)."""
        lengths = self.lengths[:, :num_slots].transpose(1, 2)
        return lengths.reshape(self.num_groups, self.num_kv_heads * num_slots)

    # ----- per step -------------------------------------------------------------------------------------
    def refresh_standard(self, slots: torch.Tensor, block_rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Rows of requests in the standard layout: head h of block b is sub-block ``b * H + h`` (pooled
        mode: ``(g * NB + b) * H + h`` in group g, the layer's own region).

        slots [n] int64, block_rows [n, Wb] int32 (their block-table rows), lengths [n] int32."""
        heads = self.num_kv_heads
        count, block_width = block_rows.shape
        rows = block_rows[:, None, :].to(torch.int32) * heads + self._head_ids[None, :, None]
        full = torch.zeros((count, heads, self.width), dtype=torch.int32, device=self.device)
        full[:, :, :block_width] = rows
        self.lengths[:, slots] = lengths[None, :, None].to(torch.int32).expand(self.num_groups, -1, heads)
        last = (self._cdiv(lengths.to(torch.int64)) - 1).clamp(min=0)[:, None, None].expand(-1, heads, 1)
        tail = full.gather(2, last)[None, ..., 0]
        if self.pooled:
            base = self._group_base[:, None, None]
            self.tables[:, slots] = full[None] + base[..., None]
            self.tail[:, slots] = tail + base
        else:
            self.tables[:, slots] = full[None].expand(self.num_groups, -1, -1, -1)
            self.tail[:, slots] = tail.expand(self.num_groups, -1, -1)
        self._mark_slots(slots)

    def grow(
        self,
        num_slots: int,
        q_lens: torch.Tensor,
        growing: torch.Tensor,
        compacted: torch.Tensor,
        block_table: torch.Tensor,
        num_blocks: torch.Tensor,
        max_new_subblocks: int,
        check: bool,
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

    def _assign_sparse(self, num_slots, need, compacted, block_table, num_blocks, max_new) -> None:
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
            self._mirror_cells(num_slots, group, head, slot, column, subblock)

    def _pool_entry(self, entry):
        """(block column after ``first_block``, offset) of pool entries ``entry`` (numpy or torch integers):
        the entry is sub-block ``row[first_block + column] * H + offset`` (pooled: offset = layer * NB * H +
        head slot)."""
        heads = self.num_kv_heads
        if not self.pooled:
            return entry // heads, entry % heads
        layer = (entry // heads) % self.num_groups
        return entry // self._span, layer * (self.layer_blocks * heads) + entry % heads

    def _mirror_cells(self, num_slots, group, head, slot, column, subblock) -> None:
        """Write cells ``tables[group, slot, head, column] = subblock`` (host arrays) into the head-major
        mirror too (columns it does not hold are never read from it)."""
        table = self._mirror.table
        if table is None:
            return
        if table.shape[2] != num_slots:
            self._mirror.drop()
            return
        room = table.shape[3]
        held = column < room
        flat = ((group * self.num_kv_heads + head) * num_slots + slot) * room + column
        table.numpy().reshape(-1)[flat[held]] = subblock[held]

    def _mark_slots(self, slots: torch.Tensor) -> None:
        """Every group's rows of ``slots`` [n] changed (read on the host only on CPU: elsewhere the mirror is
        rebuilt, which needs no device read)."""
        if slots.device.type == "cpu":
            self._mirror.mark(slice(None), slots.numpy())
        else:
            self._mirror.drop()

    def _assign_dense(self, num_slots, need, compacted, block_table, num_blocks, max_new) -> None:
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

    def token_slots(
        self,
        req_of_token: torch.Tensor | None,
        token_offset: torch.Tensor | None,
        q_lens: torch.Tensor,
        num_slots: int,
    ) -> torch.Tensor:
        """[G, T, H] int64 one-head-view slots of this step's tokens, after ``grow``.

        req_of_token [T] batch slot of each token, token_offset [T] its index among its request's tokens
        this step, q_lens [R] tokens per request (a token's position in head h is ``length - q_len +
        offset``). Both None: one token per request (decode), slot r's token is token r."""
        heads, groups = self.num_kv_heads, self.num_groups
        if req_of_token is None:
            offset = self._mod(self.lengths[:, :num_slots] - 1)
            return (self.tail[:, :num_slots] * self.block_size + offset).to(torch.int64)
        else:
            lengths = self.lengths[:, req_of_token]  # [G, T, H]
            position = (
                lengths
                - q_lens.to(torch.int32)[req_of_token][None, :, None]
                + token_offset.to(torch.int32)[None, :, None]
            )
            row = self._row_base[:, req_of_token]
        subblocks = self.tables.view(groups, -1).gather(1, (row + self._div(position)).view(groups, -1))
        slots = subblocks.view_as(position).to(torch.int64) * self.block_size + self._mod(position)
        return slots.view(groups, -1, heads)

    def _div(self, x: torch.Tensor) -> torch.Tensor:
        return x >> self._shift if self._shift is not None else x // self.block_size

    def _mod(self, x: torch.Tensor) -> torch.Tensor:
        return x & (self.block_size - 1) if self._shift is not None else x % self.block_size

    def _cdiv(self, x: torch.Tensor) -> torch.Tensor:
        return self._div(x + (self.block_size - 1))

    # ----- compaction -----------------------------------------------------------------------------------
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

    def commit(
        self,
        group: int,
        slot: int,
        table: TableRows,
        first_block: int,
        *,
        pool_cursor: int | torch.Tensor | None = None,
    ) -> None:
        """Make ``table`` the rows of ``slot`` for ``group`` (read by the next step's kernels).

        Pooled mode: the request's shared cursor becomes ``pool_cursor``, the pool entries its layers took
        (``table.pool_start + table.cursor`` when None: right when the layers are committed in layer order,
        or at least the last one last). Elsewhere ``pool_cursor`` must be None."""
        if self.pooled:
            self.pool_cursor[slot] = table.pool_start + table.cursor if pool_cursor is None else pool_cursor
        elif pool_cursor is not None:
            raise ValueError("pool_cursor is for a pooled store (layer_blocks > 0) only")
        self.tables[group, slot] = table.rows
        self.lengths[group, slot] = table.lengths
        last = (self._cdiv(table.lengths.to(torch.int64)) - 1).clamp(min=0)
        self.tail[group, slot] = table.rows.gather(1, last[:, None])[:, 0]
        self.cursor[group, slot] = table.cursor
        self.first_block[slot] = first_block
        self._mirror.mark(np.array([group]), np.array([slot]))

    # ----- requests moving between batch slots ------------------------------------------------------------
    def save(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the rows of ``slots`` [n] (requests leaving their slot)."""
        saved = {
            "tables": self.tables[:, slots].clone(),
            "lengths": self.lengths[:, slots].clone(),
            "tail": self.tail[:, slots].clone(),
            "cursor": self.cursor[:, slots].clone(),
            "first_block": self.first_block[slots].clone(),
        }
        if self.pooled:
            saved["pool_cursor"] = self.pool_cursor[slots].clone()
        return saved

    def restore(self, slots: torch.Tensor, saved: dict[str, torch.Tensor]) -> None:
        """Put rows saved by ``save`` (stacked in the same order as ``slots``) back at ``slots``."""
        self.tables[:, slots] = saved["tables"]
        self.lengths[:, slots] = saved["lengths"]
        self.tail[:, slots] = saved["tail"]
        self.cursor[:, slots] = saved["cursor"]
        self.first_block[slots] = saved["first_block"]
        if self.pooled:
            self.pool_cursor[slots] = saved["pool_cursor"]
        self._mark_slots(slots)
