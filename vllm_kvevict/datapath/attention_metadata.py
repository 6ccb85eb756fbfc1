"""The step's attention metadata for eviction, built once per step and passed down to every layer (vLLM's
pattern: a builder makes the metadata, the layers read it): the head-as-sequence view of the batch
(``HeadSequenceBatch``, one per group of layers sharing sub-block tables) and, for a batch mixing compacted
and standard-layout requests, the split into a head-as-sequence part and a ``StandardPart`` the backend's own
kernel runs. Python work here is per compacted request at most, never per decoding request or head: the
views are slices of the sub-block tensors (``BatchSubBlocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.layout.batch_tables import BatchSubBlocks, StepLayout, host_to_device


@dataclass
class HeadSequenceBatch:
    """The step's batch as (request, KV head) sequences for one group of layers sharing sub-block tables,
    head-major (sequence h*R + r: ``SubBlockStore.block_tables`` says why).

    block_table:     [H*R, max_subblocks] int32 sub-block ids of sequence h*R + r.
    seq_lens:        [H*R] int32 KV length of each sequence after this step.
    query_start_loc: [H*R + 1] int32 query rows of each sequence in the head-major query [H*T, g, D].
    slot_mapping:    [T*H] int64 one-head-view slot of (token t, head h) at t*H + h (-1: skip).
    tokens:          [Tc] int64 rows of the step's tensors these sequences attend (``StepSplit``: the
                     compacted requests' tokens), or None: every token of the step, in order.
    kernel_metadata: backend-specific data built once for this batch (e.g. CPU scheduler metadata).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    kernel_metadata: object | None = None
    tokens: torch.Tensor | None = None


@dataclass
class StandardPart:
    """The whole batch of a step that holds compacted requests and requests in vLLM's standard layout, for
    the backend's own kernel call over the step's query and output as they are (no gather): the standard
    requests attend their cache as vanilla vLLM would, each compacted one only the first ``q_len`` slots of
    its row (a dummy of its query's length, whose output rows the head-as-sequence call then overwrites).

    query_start_loc: [R + 1] int32 every request's query rows.
    seq_lens:        [R] int32 KV lengths after this step (a compacted request's: its query length).
    block_table:     [R, W] int32 vLLM's block table.
    kernel_metadata: backend-specific data built once per step (e.g. CPU scheduler metadata).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    kernel_metadata: object | None = None


@dataclass(frozen=True)
class StepSizes:
    """Host-known sizes of the step: requests, tokens, the longest sequence and query (kernels that take
    them as ints read no device), and per request [R] the lengths after the step and the prompt lengths."""

    num_reqs: int
    num_tokens: int
    max_seq_len: int
    max_query_len: int
    seq_lens: np.ndarray
    prompt_lens: np.ndarray
    q_lens: np.ndarray | None = None  # [R] tokens of each request in this step
    compacted: np.ndarray | None = None  # [R] bool: the request reads sub-block tables (None: none does)


class HeadBatchBuilder:
    """Head-as-sequence metadata of one step, built at the first layer that asks and shared by the rest.
    ``layout`` None: no request reads a compacted cache (the batch runs as vanilla vLLM)."""

    def __init__(
        self,
        sizes: StepSizes,
        shape: CacheShape,
        tables: BatchSubBlocks,
        layout: StepLayout | None,
        block_table: torch.Tensor,
    ) -> None:
        self.sizes = sizes
        self.shape = shape
        self.tables = tables
        self.layout = layout
        self.block_table = block_table
        self._per_layer: list[HeadSequenceBatch] | None = None  # built at the first head_batch call
        # split_batch's per-layer head batches of the compacted requests and the standard part
        self._split: tuple[list[HeadSequenceBatch], StandardPart] | None = None

    @property
    def has_compacted(self) -> bool:
        """True when some request reads a compacted cache: the whole batch then runs head-as-sequence."""
        return self.layout is not None

    def head_batch(self, layer_idx: int) -> HeadSequenceBatch:
        """The head-as-sequence view of the batch for ``layer_idx`` (shared by the layers of its group)."""
        if self._per_layer is None:
            layout, store = self.layout, self.tables.store
            assert layout is not None and store is not None, "head_batch needs a head-as-sequence batch"
            # Every group's views in three calls, one small object per group, then a list lookup per layer.
            num_reqs = self.sizes.num_reqs
            block_tables = store.block_tables(num_reqs, self.sizes.max_seq_len).unbind(0)
            seq_lens = store.all_seq_lens(num_reqs).unbind(0)
            slots = layout.token_slots.view(store.num_groups, -1).unbind(0)
            groups = [
                HeadSequenceBatch(block_tables[g], seq_lens[g], layout.query_start_loc, slots[g])
                for g in range(store.num_groups)
            ]
            self._per_layer = [groups[self.tables.group_of(layer)] for layer in range(self.shape.num_layers)]
        return self._per_layer[layer_idx]

    @property
    def is_mixed(self) -> bool:
        """True when the batch holds compacted requests and requests still in vLLM's standard layout."""
        compacted = self.sizes.compacted
        return compacted is not None and bool(compacted.any()) and not bool(compacted.all())

    def split_batch(self, layer_idx: int) -> tuple[HeadSequenceBatch, StandardPart | None]:
        """For a mixed batch (``is_mixed``): the head-as-sequence batch of the compacted requests only
        (sequence h*Rc + i is head h of the i-th compacted request, ``tokens`` their rows) and the standard
        part (the whole batch for the backend's own kernel, compacted requests as dummies: the backend runs
        it first). Otherwise ``(head_batch(layer_idx), None)``.

        A batch in which one compacted request decodes among standard ones (a long prompt compacted, short
        ones kept whole) then runs at vLLM's speed for all but that request: through the server, decode
        batches head-as-sequence took 1.8x vLLM's time per work unit (``benchmarks/prefix_profile.py``,
        --kv-budget 1024). Writes are unchanged (every token per head, ``HeadSequenceBatch.slot_mapping``:
        a standard request's slots are where vLLM writes them)."""
        if not self.is_mixed:
            return self.head_batch(layer_idx), None
        if self._split is None:
            self._split = self._build_split()
        per_layer, standard = self._split
        return per_layer[layer_idx], standard

    def _build_split(self) -> tuple[list[HeadSequenceBatch], StandardPart]:
        sizes, heads = self.sizes, self.shape.num_kv_heads
        assert sizes.compacted is not None and sizes.q_lens is not None
        q_lens = sizes.q_lens.astype(np.int64)
        num_reqs = sizes.num_reqs
        compacted = np.flatnonzero(sizes.compacted[:num_reqs])
        q_start = np.cumsum(q_lens) - q_lens
        head_rows = np.concatenate([np.arange(q_start[r], q_start[r] + q_lens[r]) for r in compacted])
        head_starts = np.zeros(heads * len(compacted) + 1, dtype=np.int64)
        np.cumsum(np.tile(q_lens[compacted], heads), out=head_starts[1:])
        starts = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=starts[1:])
        seq_lens = sizes.seq_lens[:num_reqs].astype(np.int64)
        seq_lens[compacted] = q_lens[compacted]  # a dummy: these rows are attended head-as-sequence
        sequences = (np.arange(heads)[:, None] * num_reqs + compacted[None, :]).reshape(-1)
        parts = [head_rows, head_starts, starts, seq_lens, sequences]
        device = self.block_table.device
        packed = host_to_device(np.concatenate([p.astype(np.int64) for p in parts]), device)
        head_tokens, head_qsl, qsl, seq_lens_dev, sequences_dev = packed.split([len(p) for p in parts])
        part = StandardPart(qsl.to(torch.int32), seq_lens_dev.to(torch.int32), self.block_table[:num_reqs])
        head_qsl = head_qsl.to(torch.int32)
        groups: dict[int, HeadSequenceBatch] = {}
        per_layer = []
        for layer in range(self.shape.num_layers):
            full = self.head_batch(layer)
            group = self.tables.group_of(layer)
            if group not in groups:
                groups[group] = HeadSequenceBatch(
                    full.block_table[sequences_dev],
                    full.seq_lens[sequences_dev],
                    head_qsl,
                    full.slot_mapping,
                    tokens=head_tokens,
                )
            per_layer.append(groups[group])
        return per_layer, part
