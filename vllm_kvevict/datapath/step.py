"""One engine step of eviction, shared by every attention layer of the step: the one call a backend makes
after each layer's attention (``after_attention``), which runs the three eviction modes of that layer and
hands their moves to the backend's cache rows. The attention metadata are ``attention_metadata.py``'s; what
the compacted prompts kept for their decode caps is returned in ``cap_starts`` and committed by the worker
at the end of the step. ``build_step`` wires it from the planner's decisions (``step_plan.py``) once the
worker applied what they ask of its state: every per-step object is made there, none of the worker's state
changes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.datapath.attention_metadata import (
    HeadBatchBuilder,
    HeadSequenceBatch,
    StandardPart,
    StepSizes,
)
from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.chunk_eviction import ChunkEviction, ChunkRescore
from vllm_kvevict.datapath.decode_rescore import DecodeEviction
from vllm_kvevict.datapath.decode_schedule import CapStarts, Rescore
from vllm_kvevict.datapath.echo_pass import EchoPass
from vllm_kvevict.datapath.executor import LayerCommit, layer_commit
from vllm_kvevict.datapath.layer_eviction import LayerTables
from vllm_kvevict.datapath.moves import CacheRows, Moves
from vllm_kvevict.datapath.prompt_eviction import PromptEviction
from vllm_kvevict.datapath.query_ring import RingWrites
from vllm_kvevict.datapath.question_echo import EchoLayer
from vllm_kvevict.datapath.records import EvictionRecords
from vllm_kvevict.datapath.step_inputs import StepRequest
from vllm_kvevict.datapath.step_plan import StepDecisions
from vllm_kvevict.datapath.step_timer import StepTimer
from vllm_kvevict.layout.batch_tables import BatchSubBlocks, StepLayout
from vllm_kvevict.policies.base import KeptTokens


@dataclass(frozen=True)
class StepWork:
    """What the planner found for one step, per mode: the whole prompts compacting, the chunks re-scored,
    the decode caps re-scored (and the ring writes of capped decoding requests), the echo pass."""

    prompts: PromptEviction
    chunk_rescores: list[ChunkRescore]
    rescores: list[Rescore]
    ring_writes: RingWrites | None = None
    echo: EchoPass | None = None


@dataclass(frozen=True)
class StepTools:
    """The worker's collaborators a step calls, and the step's own timer, tables and cap starts."""

    chunks: ChunkEviction
    decode: DecodeEviction | None
    records: EvictionRecords
    o_proj: dict[int, torch.Tensor]
    timer: StepTimer
    commit: LayerCommit
    cap_starts: CapStarts


class EvictionStep:
    """Per-step eviction work, built once per step by the worker's planner.

    Python work here is per compacting request (a prefill) and per layer, never per decoding request or
    head: the head-as-sequence metadata are views of the sub-block tensors (``HeadBatchBuilder``).
    """

    def __init__(self, metadata: HeadBatchBuilder, work: StepWork, tools: StepTools) -> None:
        self.metadata = metadata
        self.work = work
        self.tools = tools
        self.num_tokens = metadata.sizes.num_tokens
        #: some layer work follows attention in this step (a decode step without a cap has none)
        self.acts_after_attention = bool(
            work.prompts.requests or work.chunk_rescores or work.rescores or work.ring_writes
        )

    @property
    def echo(self) -> EchoPass | None:
        """Requests compacted after the step's forward, by the question echo (None: none this step)."""
        return self.work.echo

    @property
    def compacting(self) -> list[StepRequest]:
        """Requests whose whole prompt compacts in this step."""
        return self.work.prompts.requests

    @property
    def cap_starts(self) -> CapStarts:
        """What each prompt compacted in this step kept that its decode cap starts from (worker commits)."""
        return self.tools.cap_starts

    @property
    def max_seq_len(self) -> int:
        return self.metadata.sizes.max_seq_len

    @property
    def max_query_len(self) -> int:
        return self.metadata.sizes.max_query_len

    @property
    def has_compacted(self) -> bool:
        """True when some request reads a compacted cache: the whole batch then runs head-as-sequence."""
        return self.metadata.has_compacted

    # ----- head as sequence (attention_metadata.py) ----------------------------------------------------
    def head_batch(self, layer_idx: int) -> HeadSequenceBatch:
        """The head-as-sequence view of the batch for ``layer_idx`` (``HeadBatchBuilder.head_batch``)."""
        return self.metadata.head_batch(layer_idx)

    def split_batch(self, layer_idx: int) -> tuple[HeadSequenceBatch, StandardPart | None]:
        """``HeadBatchBuilder.split_batch``: the compacted requests' head batch and the standard part."""
        return self.metadata.split_batch(layer_idx)

    @property
    def pools_layers(self) -> bool:
        """True when compacted requests' sub-blocks lie in any layer's region: their writes, attention and
        moves run on the whole allocation (``vllm_adapter/pooled_cache.py``), global sub-block ids."""
        return self.metadata.tables.layer_blocks > 0

    @property
    def is_mixed(self) -> bool:
        return self.metadata.is_mixed

    # ----- after a layer's attention: the one call a backend makes ----------------------------------------
    def after_attention(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: CacheRows
    ) -> None:
        """The layer's eviction work: keep the queries a decode cap needs, compact prompts completing now,
        re-score prompts evicted between chunks and capped requests, and move their kept rows through
        ``rows``. query [T, Hq, D], key/value [T, H, D]: this step's rows, post-RoPE."""
        if self.work.ring_writes is not None:
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
        if self.work.ring_writes is not None and self.tools.decode is not None:
            self.tools.decode.record_queries(layer_idx, query, self.work.ring_writes)

    def compact_layer(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> Moves | None:
        """Whole-prompt eviction of ``layer_idx`` (``PromptEviction.compact_layer``)."""
        if not self.work.prompts.requests:
            return None
        with self.tools.timer.phase("total"):
            return self.work.prompts.compact_layer(layer_idx, query, key, value)

    def rescore_chunks(self, layer_idx: int, query: torch.Tensor, rows: CacheRows) -> Moves | None:
        """Re-score ``layer_idx`` of the requests whose prompt chunk evicts in this step (and keep the queries
        of the other prefilling ones for a later window). query [T, Hq, D]; runs after the layer's
        attention (the chunk is cached)."""
        if not self.work.chunk_rescores:
            return None
        chunks = self.tools.chunks
        with self.tools.timer.phase("total"):
            moves = chunks.rescore_layer(
                layer_idx,
                self.work.chunk_rescores,
                self.metadata.block_table,
                query,
                rows,
                self.tools.o_proj.get(layer_idx),
                self.tools.commit,
            )
            if layer_idx == self.metadata.shape.num_layers - 1:
                dumping = self.tools.records.dump_dir is not None
                for r in self.work.chunk_rescores:
                    if r.rescores_now:
                        kept = chunks.evicted.pop(r.req_id)
                        self._chunk_evicted(r, kept, r.trailing, dumping)
            return moves

    def _chunk_evicted(
        self, r: ChunkRescore, kept: list[KeptTokens | None], trailing: int, dump: bool
    ) -> None:
        """Every layer of ``r`` was re-scored (``kept``: what each holds now): the decode cap starts from a
        complete prompt's kept entries, and the request is recorded (its kept when final or dumping)."""
        if r.final and not trailing:
            for layer_idx, layer_kept in enumerate(kept):
                assert layer_kept is not None
                self.tools.cap_starts.keep(r.req_id, layer_idx, layer_kept.indices)
        recorded = kept if r.final or dump else None
        self.tools.records.chunk_evicted(r.as_request(), r.plan, r.final, recorded, trailing, r.policy.name)

    def echo_layer(self, layer_idx: int, tensors: EchoLayer, rows: CacheRows) -> None:
        """One layer of the echo forward (``echo_pass.EchoPass.layer``): attention into
        ``tensors.output``, then the deferred compaction of the layer through ``rows``; after the last layer
        the requests are recorded as compacted."""
        echo = self.work.echo
        assert echo is not None, "echo_layer runs only in a step with an echo pass"
        moves = echo.layer(layer_idx, tensors, rows)
        if moves is not None and moves.slots.numel():
            rows.move(moves)
        if layer_idx == self.metadata.shape.num_layers - 1:
            dumping = self.tools.records.dump_dir is not None
            for r in echo.requests:
                self._chunk_evicted(r.rescore, echo.kept.pop(r.rescore.req_id), 0, dumping)

    def rescore_layer(self, layer_idx: int, rows: CacheRows) -> Moves | None:
        """Re-score ``layer_idx`` of the requests whose decode cap re-scores in this step. Runs after the
        layer's attention (this step's token is cached)."""
        if not self.work.rescores or self.tools.decode is None:
            return None
        with self.tools.timer.phase("total"):
            moves = self.tools.decode.rescore_layer(
                layer_idx,
                self.work.rescores,
                self.metadata.block_table,
                rows,
                self.tools.commit,
            )
            if layer_idx == self.metadata.shape.num_layers - 1:
                for r in self.work.rescores:
                    self.tools.records.rescored(
                        r.req_id, r.slot, r.record.plan, r.generated, self.tools.decode.policy.name
                    )
            return moves

    def publish(self) -> None:
        """The step is over: its eviction time by phase and the batch's resident entries (metrics)."""
        self.tools.records.publish_step(
            self.metadata.sizes.num_reqs,
            self.metadata.sizes.seq_lens,
            self.metadata.sizes.prompt_lens,
            self.tools.timer.seconds,
        )


@dataclass(frozen=True)
class WorkerParts:
    """The worker's collaborators a step works with: the worker owns them, the step's layers change them."""

    shape: CacheShape
    tables: BatchSubBlocks
    chunks: ChunkEviction
    decode: DecodeEviction | None
    records: EvictionRecords
    o_proj: dict[int, torch.Tensor]


def build_step(
    decided: StepDecisions,
    layout: StepLayout | None,
    decode_work: tuple[RingWrites | None, list[Rescore]],
    parts: WorkerParts,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> EvictionStep:
    """The step from the planner's decisions, once the worker prepared its state (caps admitted, tables
    split, rows grown into ``layout``, None: no request reads a compacted cache); wiring only.
    decode_work: the capped requests' ring writes and re-scores. block_table [R', W] / slot_mapping [T']:
    vLLM's tensors on the cache's device."""
    sizes = StepSizes(
        len(decided.q_lens),
        int(decided.q_lens.sum()),
        max_seq_len=int(decided.seq_lens.max(initial=0)),
        max_query_len=int(decided.q_lens.max(initial=0)),
        seq_lens=decided.seq_lens,
        prompt_lens=decided.prompt_lens,
        q_lens=decided.q_lens,
        compacted=decided.compacted if layout is not None else None,
    )
    timer = StepTimer()
    commit = layer_commit(LayerTables(parts.tables, block_table.device.type == "cpu"), parts.shape, timer)
    cap_starts = CapStarts(parts.decode.records if parts.decode is not None else {}, parts.shape.num_layers)
    prompts = PromptEviction(
        decided.compacting,
        parts.shape,
        parts.tables,
        (block_table, slot_mapping),
        parts.o_proj,
        parts.chunks.rope_inv_freq,
        parts.decode,
        parts.records,
        commit,
        cap_starts,
    )
    echo = None
    if decided.echo_requests:
        echo = EchoPass(decided.echo_requests, parts.chunks, block_table, parts.o_proj, timer, commit)
    ring_writes, rescores = decode_work
    work = StepWork(prompts, decided.chunks, rescores, ring_writes, echo)
    tools = StepTools(parts.chunks, parts.decode, parts.records, parts.o_proj, timer, commit, cap_starts)
    metadata = HeadBatchBuilder(sizes, parts.shape, parts.tables, layout, block_table)
    return EvictionStep(metadata, work, tools)
