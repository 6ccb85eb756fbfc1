"""What one layer of one request holds (``HeldEntries``), where its kept entries go (``LayerTarget``) and
the tables a step assigns layer by layer (``LayerTables``): the parts of the description every mode gives
the executor (``executor.LayerWork``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_kvevict.datapath.placement import subblock_slots
from vllm_kvevict.layout.accounting import first_block_for_bound, layer_kept_bound
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.shared_prefix import shared_blocks
from vllm_kvevict.layout.subblock_ids import TableRows
from vllm_kvevict.policies.base import KeptTokens


@dataclass(frozen=True)
class HeldEntries:
    """What each head of one request's layer holds: slots [H, L] int64 one-head-view cache slots and
    positions [H, L] int64, -1 padded. ``step_row``: the held entries are rows of this step's tensors
    (position p is row ``step_row + p``, a prompt computed in this step), None: they are read from the
    cache. ``in_store``: the slots are the sub-block store's (of the whole allocation where it pools layers),
    else the layer's own view of vLLM's standard layout."""

    slots: torch.Tensor
    positions: torch.Tensor
    step_row: int | None = None
    in_store: bool = False

    @staticmethod
    def of_step_rows(
        slot_mapping: torch.Tensor, start: int, length: int, heads: int, block_size: int
    ) -> HeldEntries:
        """The ``length`` rows from ``start`` of this step's tensors, written to vLLM's standard layout at
        ``slot_mapping`` [T] (head h of a token in sub-block ``block * H + h``)."""
        standard = slot_mapping[start : start + length].to(torch.int64)
        head = torch.arange(heads, device=standard.device)[:, None]
        slots = ((standard // block_size)[None, :] * heads + head) * block_size + standard % block_size
        positions = torch.arange(length, device=standard.device).expand(heads, length)
        return HeldEntries(slots, positions, start)

    @property
    def width(self) -> int:
        return self.slots.shape[1]


def held_in_store(
    tables: BatchSubBlocks,
    layer_idx: int,
    slot: int,
    held: torch.Tensor,
    tail_from: int,
    tail_to: int,
    req_id: str,
    check: bool,
) -> HeldEntries:
    """What each head of a compacted request holds in its sub-blocks: the positions ``held`` [H, a] (-1
    padded) kept at its last compaction, then every position in ``[tail_from, tail_to)`` appended since."""
    store = tables.store
    assert store is not None
    heads = held.shape[0]
    group = tables.group_of(layer_idx)
    device = held.device
    counts = (held >= 0).sum(dim=1)
    lengths = counts + (tail_to - tail_from)
    width = int(lengths.max()) if heads else 0
    j = torch.arange(width, device=device)
    slots = subblock_slots(store.tables[group, slot], width, store.block_size)
    if held.shape[1]:
        from_held = held.gather(1, j.clamp(max=held.shape[1] - 1).expand(heads, width))
    else:
        from_held = torch.zeros(heads, width, dtype=torch.int64, device=device)
    positions = torch.where(j[None, :] < counts[:, None], from_held, tail_from + j[None, :] - counts[:, None])
    stored = store.lengths[group, slot].to(torch.int64)
    if check and not torch.equal(stored, lengths):  # a device read: CPU only
        raise RuntimeError(
            f"request {req_id} layer {layer_idx}: heads hold {stored.tolist()} entries, the record "
            f"{lengths.tolist()}"
        )
    valid = j[None, :] < lengths[:, None]
    return HeldEntries(torch.where(valid, slots, -1), torch.where(valid, positions, -1), in_store=True)


@dataclass(frozen=True)
class LayerTarget:
    """Where one request's kept entries go: its block-table row [W], the first block whose sub-blocks take
    them, the blocks it keeps, ``trailing`` entries per head kept whole after the chosen ones and ``shared``
    leading entries per head of a prefix other requests share (kept where they are).

    ``adaptive_prompt``: the prompt length P of an adaptive plan (0: none). The layer's kept count is then
    set by its scores, and its entries start at the first block its own bound leaves (``for_kept``), at or
    after ``first_block`` (the ceiling's, where the request's pool starts: ``pool_block``). Ranked across
    layers, ``pooled_first`` (None: ``first_block``) gives the first block from every layer's kept entries
    (an adaptive plan's bound, ``pooled_eviction.pooled_plan``)."""

    slot: int
    req_id: str
    block_row: torch.Tensor
    first_block: int
    num_blocks: int
    trailing: int = 0
    shared: int = 0
    adaptive_prompt: int = 0
    pool_block: int = -1
    pooled_first: Callable[[list[KeptTokens]], int] | None = None

    def for_kept(self, total: int, heads: int, block_size: int) -> LayerTarget:
        """This target once the layer's heads keep ``total`` entries: for an adaptive plan its entries start
        at the first block of the layer's bound (``accounting.layer_kept_bound``), itself otherwise."""
        if not self.adaptive_prompt:
            return self
        bound = layer_kept_bound(self.adaptive_prompt, total, heads, block_size)
        first = max(self.first_block, first_block_for_bound(self.adaptive_prompt, bound, block_size))
        return dataclasses.replace(self, first_block=first, pool_block=self.first_block)


class LayerTables:
    """Tables assigned in one step: a group of layers sharing sub-block tables takes the table its first
    layer assigned (checked at the others), and commits it after its last layer."""

    def __init__(self, tables: BatchSubBlocks, check: bool) -> None:
        self.tables = tables
        self.check = check
        self._pending: dict[tuple[str, int], tuple[TableRows, torch.Tensor]] = {}

    def table_for(
        self, layer_idx: int, target: LayerTarget, counts: torch.Tensor, total: int, method: str
    ) -> TableRows:
        """The table of ``target`` for the group of ``layer_idx``, whose heads keep ``counts`` [H] (sum
        ``total``, host-known) then the trailing entries."""
        key = (target.req_id, self.tables.group_of(layer_idx))
        pending = self._pending.get(key)
        if pending is not None:
            table, assigned = pending
            if self.check and not torch.equal(assigned.to(counts.dtype), counts):
                raise RuntimeError(
                    f"policy {method} kept different per-head counts in layers that share one sub-block "
                    f"table (layer {layer_idx}); it must not be treated as uniform"
                )
            return table
        store = self.tables.store
        assert store is not None
        table = store.assign(
            counts,
            target.block_row,
            target.first_block,
            target.trailing,
            total,
            num_blocks=target.num_blocks,
            check=self.check,
            shared_blocks=shared_blocks(target.shared, store.block_size),
        )
        self._pending[key] = (table, counts)
        return table

    def commit(self, layer_idx: int, target: LayerTarget) -> None:
        """After the last layer of a group, the group's table becomes the request's rows. A layer of an
        adaptive plan whose entries start after the request's pool block counts the blocks between as taken
        (its growth continues after its own entries; every layer's pool starts at the same block)."""
        if self.tables.last_layer_of_group(layer_idx):
            table, _ = self._pending.pop((target.req_id, self.tables.group_of(layer_idx)))
            first = target.first_block
            if 0 <= target.pool_block < first:
                table.cursor = table.cursor + (first - target.pool_block) * self.tables.num_kv_heads
                first = target.pool_block
            self.tables.commit(layer_idx, target.slot, table, first)
