"""Per-head sub-block tables of the running batch as persistent integer tensors on the cache's device.

The same tables as ``tests/unit/layout/subblock_reference.py`` (the plain model they are tested against),
laid out for the attention kernels: row ``(slot, head)`` of group ``g`` is the sub-block table of KV head
``head`` of the request in batch slot ``slot`` (vLLM's persistent input-batch order) for the layers of
group ``g``. The kernels read head-major tables (sequence ``h * R + r``, ``block_tables`` says why): a
mirror of ``tables`` in that order is kept and patched where the tables changed (``head_mirror.py``), so a
steady decode step copies only the cells it wrote, not every group's tables (32 groups for Ada-KV). Rows
grow in ``table_growth.py``; which sub-blocks a row holds: ``subblock_ids.py``.

Groups: layers whose heads keep equal counts can share one group (SnapKV-like policies: one group for all
layers); otherwise each layer is its own group (Ada-KV). No vLLM import.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_kvevict.layout.head_mirror import HeadMirror
from vllm_kvevict.layout.subblock_ids import TableRows
from vllm_kvevict.layout.table_growth import TableGrowth


def _grown(old: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero tensor of ``shape`` holding ``old`` in its leading corner."""
    new = old.new_zeros(shape)
    new[tuple(slice(0, n) for n in old.shape)] = old
    return new


class SubBlockStore(TableGrowth):
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
        self, num_groups: int, num_kv_heads: int, block_size: int, width: int, capacity: int,
        device: torch.device | str, layer_blocks: int = 0,
    ) -> None:
        super().__init__(num_groups, num_kv_heads, block_size, width, device, layer_blocks)
        self.capacity = 0
        shape = (num_groups, 0, num_kv_heads)
        self.tables, self.lengths, self.tail, self.cursor, self.first_block, self.pool_cursor = (
            torch.zeros(size, dtype=torch.int32, device=self.device)
            for size in ((*shape, width), shape, shape, shape[:2], 0, 0)
        )
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
        groups, heads = self.num_groups, self.num_kv_heads
        self.tables = _grown(self.tables, (groups, capacity, heads, width))
        self.lengths = _grown(self.lengths, (groups, capacity, heads))
        self.tail = _grown(self.tail, (groups, capacity, heads))
        self.cursor = _grown(self.cursor, (groups, capacity))
        self.first_block = _grown(self.first_block, (capacity,))
        self.pool_cursor = _grown(self.pool_cursor, (capacity if self.pooled else 0,))
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
        table = self._mirror.refresh(self.tables, num_slots, width)
        return table.view(self.num_groups, self.num_kv_heads * num_slots, table.shape[3])

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
        self._mirror.mark_slots(slots)

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
        lengths = self.lengths[:, req_of_token]  # [G, T, H]
        from_end = q_lens.to(torch.int32)[req_of_token] - token_offset.to(torch.int32)  # [T], the last is 1
        position = lengths - from_end[None, :, None]
        row = self._row_base[:, req_of_token]
        subblocks = self.tables.view(groups, -1).gather(1, (row + self._div(position)).view(groups, -1))
        slots = subblocks.view_as(position).to(torch.int64) * self.block_size + self._mod(position)
        return slots.view(groups, -1, heads)

    # ----- compaction -----------------------------------------------------------------------------------
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
    def _by_slot(self) -> dict[str, torch.Tensor]:
        """Every tensor a batch slot has rows in, by name (the slot is dim 1 of [G, S, ...], dim 0 of [S])."""
        names = ["tables", "lengths", "tail", "cursor", "first_block"] + ["pool_cursor"] * self.pooled
        return {name: getattr(self, name) for name in names}

    def save(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the rows of ``slots`` [n] int64 (requests leaving their slot), stacked in that order."""
        return {name: t.index_select(1 if t.dim() > 1 else 0, slots) for name, t in self._by_slot().items()}

    def restore(self, slots: torch.Tensor, saved: dict[str, torch.Tensor]) -> None:
        """Put rows saved by ``save`` (stacked in the same order as ``slots``) back at ``slots``."""
        for name, t in self._by_slot().items():
            t.index_copy_(1 if t.dim() > 1 else 0, slots, saved[name])
        self._mirror.mark_slots(slots)
