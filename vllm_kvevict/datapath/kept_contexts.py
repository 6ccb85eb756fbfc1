"""Kept contexts on a worker (``layout/context_reuse.py``): a request asking ``kv_context: "keep"`` is a
creator, whose prompt as eviction sees it is its block-aligned context, or a reader, which starts from a
creator's kept entries. A collaborator of ``EvictionWorker``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from vllm_kvevict.datapath.records import EvictionRecords
from vllm_kvevict.datapath.step_inputs import StepInputs
from vllm_kvevict.layout.accounting import RequestPlan
from vllm_kvevict.layout.batch_tables import BatchSubBlocks, host_to_device
from vllm_kvevict.layout.context_reuse import (
    EntryBlocks,
    EntryCounts,
    context_plan,
    entry_blocks,
    keeps_entry,
)
from vllm_kvevict.layout.subblock_ids import TableRows


@dataclasses.dataclass(frozen=True)
class ContextRead:
    """A request that starts from a kept context: where the entry lies, and whether its creator kept ragged
    counts (Ada-KV: per layer and head, looked up in ``EntryCounts`` by the entry's first block)."""

    entry: EntryBlocks
    ragged: bool


class KeptContexts:
    """Creators -> their context length (their prompt as eviction sees it); readers -> the entry they start
    from, until their tables are set up; Ada-KV's creators whose ragged counts are still to be recorded, and
    the counts by entry block (``EntryCounts``)."""

    def __init__(self, tables: BatchSubBlocks, records: EvictionRecords, num_layers: int) -> None:
        self.tables = tables
        self.records = records
        self.num_layers = num_layers
        self.lens: dict[str, int] = {}
        self.readers: dict[str, ContextRead] = {}
        self.ragged_creators: set[str] = set()
        self.entry_counts = EntryCounts()

    def note(
        self,
        req_id: str,
        shared: int,
        prompt_len: int,
        plan_for: Callable[[int], RequestPlan],
        ragged: bool,
    ) -> None:
        """A request seen for the first time that asked to keep its context: a reader when it starts with
        ``shared`` computed tokens (only a kept context gives it any), else a creator."""
        if shared > 0:
            context = plan_for(shared)
            if not keeps_entry(context):
                raise RuntimeError(f"request {req_id} starts from a kept context its setting cannot leave")
            self.readers[req_id] = ContextRead(entry_blocks(context), ragged)
            return
        plan = context_plan(plan_for, prompt_len, 0, self.tables.block_size, self.num_layers)
        if keeps_entry(plan) and plan.prompt_len != prompt_len:
            self.lens[req_id] = plan.prompt_len
        if keeps_entry(plan) and ragged:
            self.ragged_creators.add(req_id)

    def as_seen(self, inputs: StepInputs) -> StepInputs:
        """``inputs`` with each creator's prompt length its context's."""
        if not self.lens:
            return inputs
        prompt_lens = np.array(inputs.prompt_lens, copy=True)
        for slot, req_id in enumerate(inputs.req_ids):
            prompt_lens[slot] = self.lens.get(req_id, prompt_lens[slot])
        return dataclasses.replace(inputs, prompt_lens=prompt_lens)

    def drop(self, req_id: str) -> None:
        self.lens.pop(req_id, None)
        self.readers.pop(req_id, None)
        self.ragged_creators.discard(req_id)

    def record_entries(self, req_ids: list[str], block_table: torch.Tensor) -> None:
        """Ada-KV creators whose context was compacted in this step: record each head's kept count per
        layer by the entry's first block, where its readers will look them up."""
        for slot, req_id in enumerate(req_ids):
            counts = self.records.prompt_counts.get(req_id)
            if req_id not in self.ragged_creators or counts is None:
                continue
            first = self.records.requests[req_id].blocks_to_free
            self.entry_counts.record(int(block_table[slot, first]), counts)
            self.ragged_creators.discard(req_id)

    def start_readers(self, req_ids: list[str], block_table: torch.Tensor, check: bool) -> None:
        """Requests starting from a kept context read it from their first step: each head holds its kept
        entries (B' each, or an Ada-KV creator's counts per layer), in pool order from the entry's first
        block (``layout/context_reuse.py``); their own tokens then grow into fresh sub-blocks from the block
        after it."""
        store = self.tables.store
        assert store is not None
        heads, bs = self.tables.num_kv_heads, self.tables.block_size
        for slot, req_id in enumerate(req_ids):
            read = self.readers.pop(req_id, None)
            if read is None:
                continue
            entry = read.entry
            if read.ragged:
                self.tables.split()
                per_group = self.entry_counts.counts_of(int(block_table[slot, entry.reader_first]))
            else:
                per_group = [[entry.per_head] * heads] * store.num_groups
            tables: dict[tuple[int, ...], TableRows] = {}  # groups with the same counts share one
            taken = 0  # a pooled store: each layer's sub-blocks follow the earlier layers' in the one pool
            for group in range(store.num_groups):
                counts = tuple(per_group[group])
                if counts not in tables or store.pooled:
                    tables[counts] = store.assign(
                        host_to_device(np.array(counts), store.device),
                        block_table[slot],
                        entry.reader_first,
                        0,
                        total=sum(counts),
                        num_blocks=entry.context_tokens // bs,
                        check=check,
                        pool_start=taken,
                    )
                    taken += int(tables[counts].cursor) if store.pooled else 0
                cursor = {"pool_cursor": taken} if store.pooled else {}
                store.commit(group, slot, tables[counts], entry.reader_first, **cursor)
            self.tables.mark_compacted(slot)
            self.records.restart(slot, req_id)
