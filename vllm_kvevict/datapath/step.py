"""One engine step of eviction, shared by every attention layer of the step: the head-as-sequence view of
the batch, and the one call a backend makes after each layer's attention (``after_attention``), which runs
the three eviction modes of that layer and hands their moves to the backend's cache rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.chunk_eviction import ChunkEviction, ChunkRescore
from vllm_kvevict.datapath.decode_eviction import DecodeEviction
from vllm_kvevict.datapath.decode_schedule import Rescore
from vllm_kvevict.datapath.layer_eviction import LayerTables
from vllm_kvevict.datapath.moves import CacheRows, Moves
from vllm_kvevict.datapath.prompt_eviction import PromptEviction
from vllm_kvevict.datapath.query_ring import RingWrites
from vllm_kvevict.datapath.question_echo import EchoLayer, EchoPass
from vllm_kvevict.datapath.records import EvictionRecords, StepTimer
from vllm_kvevict.datapath.step_inputs import StepRequest
from vllm_kvevict.layout.batch_tables import BatchSubBlocks, StepLayout, host_to_device
from vllm_kvevict.policies.base import KeptTokens


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


class EvictionStep:
    """Per-step eviction data and work, built once per step by the worker's planner with its collaborators.

    Python work here is per compacting request (a prefill) and per layer, never per decoding request or
    head: the head-as-sequence metadata are views of the sub-block tensors (``BatchSubBlocks``).
    """

    def __init__(
        self,
        sizes: StepSizes,
        shape: CacheShape,
        tables: BatchSubBlocks,
        layout: StepLayout | None,
        block_table: torch.Tensor,
        prompts: PromptEviction,
        chunks: ChunkEviction,
        chunk_rescores: list[ChunkRescore],
        decode: DecodeEviction | None,
        ring_writes: RingWrites | None,
        rescores: list[Rescore],
        records: EvictionRecords,
        o_proj: dict[int, torch.Tensor],
        timer: StepTimer,
        layer_tables: LayerTables,
        echo: EchoPass | None = None,
    ) -> None:
        self.sizes = sizes
        #: requests compacted after the step's forward, by the question echo (None: none this step)
        self.echo = echo
        self.num_tokens = sizes.num_tokens
        self.shape = shape
        self.tables = tables
        self.compacting: list[StepRequest] = prompts.requests
        self.chunks = chunk_rescores
        self.ring_writes = ring_writes
        self.rescores = rescores
        self.timer = timer
        self._layout = layout
        self._block_table = block_table
        self._prompts = prompts
        self._chunk_eviction = chunks
        self._decode = decode
        self._records = records
        self._o_proj = o_proj
        self._layer_tables = layer_tables
        #: some layer work follows attention in this step (a decode step without a cap has none)
        self.acts_after_attention = bool(prompts.requests or chunk_rescores or rescores or ring_writes)
        self._per_layer: list[HeadSequenceBatch] | None = None  # built at the first head_batch call
        # split_batch's per-layer head batches of the compacted requests and the standard part
        self._split: tuple[list[HeadSequenceBatch], StandardPart] | None = None
        self._chunk_kept: dict[str, list[KeptTokens]] = {}  # req -> per layer (final; all when dumping)

    @property
    def max_seq_len(self) -> int:
        return self.sizes.max_seq_len

    @property
    def max_query_len(self) -> int:
        return self.sizes.max_query_len

    @property
    def has_compacted(self) -> bool:
        """True when some request reads a compacted cache: the whole batch then runs head-as-sequence."""
        return self._layout is not None

    # ----- head as sequence -----------------------------------------------------------------------------
    def head_batch(self, layer_idx: int) -> HeadSequenceBatch:
        """The head-as-sequence view of the batch for ``layer_idx`` (shared by the layers of its group)."""
        if self._per_layer is None:
            layout, store = self._layout, self.tables.store
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
        device = self._block_table.device
        packed = host_to_device(np.concatenate([p.astype(np.int64) for p in parts]), device)
        head_tokens, head_qsl, qsl, seq_lens_dev, sequences_dev = packed.split([len(p) for p in parts])
        part = StandardPart(qsl.to(torch.int32), seq_lens_dev.to(torch.int32), self._block_table[:num_reqs])
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

    # ----- after a layer's attention: the one call a backend makes ----------------------------------------
    def after_attention(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: CacheRows
    ) -> None:
        """The layer's eviction work: keep the queries a decode cap needs, compact prompts completing now,
        re-score prompts evicted between chunks and capped requests, and move their kept rows through
        ``rows``. query [T, Hq, D], key/value [T, H, D]: this step's rows, post-RoPE."""
        if self.ring_writes is not None:
            self.record_queries(layer_idx, query)
        for moves in (
            self.compact_layer(layer_idx, query, key, value),
            self.rescore_chunks(layer_idx, query, rows),
            self.rescore_layer(layer_idx, rows),
        ):
            if moves is not None and moves.slots.numel():
                rows.move(moves)

    def record_queries(self, layer_idx: int, query: torch.Tensor) -> None:
        """Keep the queries [T, Hq, D] of capped decoding requests (one batched write per layer)."""
        if self.ring_writes is not None and self._decode is not None:
            self._decode.record_queries(layer_idx, query, self.ring_writes)

    def compact_layer(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> Moves | None:
        """Whole-prompt eviction of ``layer_idx`` (``PromptEviction.compact_layer``)."""
        if not self.compacting:
            return None
        with self.timer.phase("total"):
            return self._prompts.compact_layer(layer_idx, query, key, value)

    def rescore_chunks(self, layer_idx: int, query: torch.Tensor, rows: CacheRows) -> Moves | None:
        """Re-score ``layer_idx`` of the requests whose prompt chunk evicts in this step (and keep the queries
        of the other prefilling ones for a later window). query [T, Hq, D]; runs after the layer's
        attention (the chunk is cached)."""
        if not self.chunks:
            return None
        with self.timer.phase("total"):
            moves, results = self._chunk_eviction.rescore_layer(
                layer_idx,
                self.chunks,
                self._block_table,
                query,
                rows,
                self._o_proj.get(layer_idx),
                self.timer,
                self._layer_tables,
            )
            dumping = self._records.dump_dir is not None
            for r, result in zip(self.chunks, results, strict=True):
                if result is None or not (r.final or dumping):
                    continue
                self._chunk_kept.setdefault(r.req_id, []).append(result)
                record = self._decode.records.get(r.req_id) if self._decode is not None else None
                if (
                    r.final and record is not None and not r.trailing
                ):  # the decode cap starts from the prompt's
                    record.positions[layer_idx] = result.indices
            if layer_idx == self.shape.num_layers - 1:
                for r in self.chunks:
                    if r.rescores_now:
                        kept = self._chunk_kept.pop(r.req_id, None)
                        self._records.chunk_evicted(
                            r.as_request(), r.plan, r.final, kept, r.trailing, r.policy.name
                        )
            return moves

    def echo_layer(self, layer_idx: int, tensors: EchoLayer, rows: CacheRows) -> None:
        """One layer of the echo forward (``question_echo.EchoPass.layer``): attention into
        ``tensors.output``, then the deferred compaction of the layer through ``rows``; after the last layer
        the requests are recorded as compacted."""
        echo = self.echo
        assert echo is not None, "echo_layer runs only in a step with an echo pass"
        moves = echo.layer(layer_idx, tensors, rows)
        if moves is not None and moves.slots.numel():
            rows.move(moves)
        for r in echo.requests:
            record = self._decode.records.get(r.rescore.req_id) if self._decode is not None else None
            if record is not None and r.rescore.final:  # the decode cap starts from the prompt's kept entries
                record.positions[layer_idx] = echo.kept[r.rescore.req_id][layer_idx].indices
        if layer_idx == self.shape.num_layers - 1:
            dumping = self._records.dump_dir is not None
            for r in echo.requests:
                rescore = r.rescore
                kept = echo.kept.pop(rescore.req_id)
                self._records.chunk_evicted(
                    rescore.as_request(),
                    rescore.plan,
                    rescore.final,
                    kept if rescore.final or dumping else None,
                    0,
                    rescore.policy.name,
                )

    def rescore_layer(self, layer_idx: int, rows: CacheRows) -> Moves | None:
        """Re-score ``layer_idx`` of the requests whose decode cap re-scores in this step. Runs after the
        layer's attention (this step's token is cached)."""
        if not self.rescores or self._decode is None:
            return None
        with self.timer.phase("total"):
            moves = self._decode.rescore_layer(
                layer_idx, self.rescores, self._block_table, rows, self.timer, self._layer_tables
            )
            if layer_idx == self.shape.num_layers - 1:
                for r in self.rescores:
                    self._records.rescored(r.req_id, r.slot, r.record.plan, r.generated)
            return moves

    def publish(self) -> None:
        """The step is over: its eviction time by phase and the batch's resident entries (metrics)."""
        self._records.publish_step(
            self.sizes.num_reqs, self.sizes.seq_lens, self.sizes.prompt_lens, self.timer.seconds
        )
