"""Worker-side orchestration of eviction, one step at a time (device-agnostic; kernels live in the backends).

``EvictionWorker`` is the single owner of eviction state on a worker: which requests are compacted, their
sub-block tables (``layout.batch_tables.BatchSubBlocks``: tensors on the cache's device), the policy, and
the o_proj weights CriticalKV needs. The model-runner hooks (``runner_hooks.py``) hand it each step's request
ids and token counts; the attention metadata builder turns them into an ``EvictionStep``, which every
attention layer of that step reads:

- requests compacted in an earlier step get room for this step's tokens in each of their tables, and the
  step exposes, per layer, a ``HeadSequenceBatch``: the batch reshaped so each (request, KV head) is one
  sequence with its own sub-block table row and length ("head as sequence"); requests still in the
  standard layout appear there with sub-blocks ``block * H + h`` and the full length;
- requests whose prompt completes in this step and whose plan compacts are scored and compacted layer by
  layer, right after that layer's attention, from the keys/values/queries the layer has in hand;
- requests whose prompt arrives in several steps (chunked prefill) are re-scored, layer by layer after
  attention, from what they hold in the cache, after each chunk whose rule says so (``chunk_eviction.py``);
- with a decode-time cap (``decode_eviction.py``), the step keeps the queries of capped decoding requests
  and re-scores, layer by layer after attention, the requests whose rule says so in this step.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vllm_kvevict.layout.accounting import RequestPlan, cdiv
from vllm_kvevict.layout.batch_tables import BatchSubBlocks, StepLayout
from vllm_kvevict.layout.subblock_store import TableRows, head_token_index
from vllm_kvevict.layout.subblock_table import SubBlockTable
from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens, LayerKV, ScoredPolicy
from vllm_kvevict.vllm_adapter import metrics
from vllm_kvevict.vllm_adapter.chunk_eviction import (
    ChunkEviction,
    ChunkMoves,
    ChunkRescore,
    LayerResult,
    RowReader,
)
from vllm_kvevict.vllm_adapter.config import EvictionConfig
from vllm_kvevict.vllm_adapter.decode_eviction import (
    DecodeEviction,
    DecodeMoves,
    DecodeRecord,
    KeyReader,
    Rescore,
    RingWrites,
)
from vllm_kvevict.vllm_adapter.policy_guard import guarded_select
from vllm_kvevict.vllm_adapter.request_settings import RequestSettings, decode_policy

logger = logging.getLogger("vllm.kvevict.eviction_step")

#: When set, the worker saves each compacted request's kept indices per layer/head there (off by default).
DEBUG_DUMP_ENV = "KVEVICT_DEBUG_DUMP_DIR"


@dataclass(frozen=True)
class StepInputs:
    """What the model runner knows about this step's batch, in batch order (one entry per request)."""

    req_ids: list[str]
    prompt_lens: np.ndarray  # [R] prompt tokens
    computed: np.ndarray  # [R] tokens already in the cache before this step
    scheduled: np.ndarray  # [R] tokens computed in this step
    extra_args: list[dict | None] | None = None  # [R] SamplingParams.extra_args (per-request settings)


@dataclass
class StepRequest:
    """One request of the step. Its tokens are rows [q_start, q_start + q_len) of the step's tensors."""

    index: int
    req_id: str
    q_start: int
    q_len: int
    seq_len: int  # computed + q_len
    prompt_len: int
    plan: RequestPlan | None = None  # compacts in this step
    policy: EvictionPolicy | None = None  # the request's policy when it compacts in this step
    decode: DecodeRecord | None = None  # its decode cap already applies in this step (a recomputed request)


@dataclass
class HeadSequenceBatch:
    """The step's batch as (request, KV head) sequences for one group of layers sharing sub-block tables.

    block_table:     [R*H, max_subblocks] int32 sub-block ids of sequence r*H + h.
    seq_lens:        [R*H] int32 KV length of each sequence after this step.
    query_start_loc: [R*H + 1] int32 query rows of each sequence in the gathered query.
    slot_mapping:    [T*H] int64 one-head-view slot of (token t, head h) at t*H + h (-1: skip).
    kernel_metadata: backend-specific data built once for this batch (e.g. CPU scheduler metadata).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    kernel_metadata: object | None = None


@dataclass(frozen=True)
class CompactionWrite:
    """The kept entries of a layer, [K] int64 each: row ``key[tokens, heads]`` of the step's tensors, already
    cached at one-head-view slot ``src_slots`` (standard layout), goes to slot ``slots`` (its sub-block)."""

    tokens: torch.Tensor
    heads: torch.Tensor
    slots: torch.Tensor
    src_slots: torch.Tensor


class EvictionStep:
    """Per-step eviction data shared by every attention layer of the step (built once by the builder).

    Python work here is per compacting request (a prefill) and per layer, never per decoding request or
    head: the head-as-sequence metadata are views of the worker's sub-block tensors (``BatchSubBlocks``).
    """

    def __init__(
        self,
        worker: EvictionWorker,
        compacting: list[StepRequest],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_reqs: int,
        num_tokens: int,
        layout: StepLayout | None,
        max_seq_len: int,
        max_query_len: int,
        seq_lens: np.ndarray,
        prompt_lens: np.ndarray,
        ring_writes: RingWrites | None = None,
        rescores: list[Rescore] | None = None,
        chunks: list[ChunkRescore] | None = None,
    ) -> None:
        self.worker = worker
        self.compacting = compacting
        self.chunks = chunks or []
        self._chunk_kept: dict[str, list[LayerResult]] = {}  # req -> per layer (final; all when dumping)
        self.ring_writes = ring_writes
        self.rescores = rescores or []
        self.num_reqs = num_reqs
        self.num_tokens = num_tokens
        self.max_seq_len = max_seq_len  # host bounds for kernels that take them as ints (no device read)
        self.max_query_len = max_query_len
        self.seq_lens = seq_lens  # [R] host copies, for metrics
        self.prompt_lens = prompt_lens
        self._layout = layout
        self._block_table = block_table
        self._slot_mapping = slot_mapping
        self._per_layer: list[HeadSequenceBatch] | None = None  # built at the first head_batch call
        self._pending: dict[tuple[str, int], TableRows] = {}  # (req, group) -> table not yet committed
        self._kept_for_dump: dict[str, list[KeptTokens]] = {}
        self._kept_counts: dict[str, list[torch.Tensor]] = {}  # req -> per layer [H] kept, for metrics
        self.eviction_seconds = 0.0  # scoring, selection and compaction planning in this step

    @property
    def evicts(self) -> bool:
        """True when some layer work follows attention: a prompt compacts or a decode cap re-scores."""
        return bool(self.compacting or self.rescores or self.chunks)

    @property
    def has_compacted(self) -> bool:
        """True when some request reads a compacted cache: the whole batch then runs head-as-sequence."""
        return self._layout is not None

    # ----- head as sequence -----------------------------------------------------------------------------
    def sequence_rows(self) -> torch.Tensor | None:
        """[T*H] int64 ``token * H + head`` of each row of the head-as-sequence query (sequence r*H + h, then
        the request's tokens), indexing ``query.reshape(T*H, g, D)``; None when every request has one token
        this step (pure decode): the order is then the identity and no gather is needed."""
        assert self._layout is not None, "sequence_rows is only defined when the batch runs head-as-sequence"
        return self._layout.sequence_rows

    def head_batch(self, layer_idx: int) -> HeadSequenceBatch:
        """The head-as-sequence view of the batch for ``layer_idx`` (shared by the layers of its group)."""
        if self._per_layer is None:
            layout = self._layout
            assert layout is not None, "head_batch is only defined when the batch runs head-as-sequence"
            tables = self.worker.tables
            store = tables.store
            assert store is not None
            # Every group's views in three calls, one small object per group, then a list lookup per layer.
            block_tables = store.block_tables(self.num_reqs).unbind(0)
            seq_lens = store.all_seq_lens(self.num_reqs).unbind(0)
            slots = layout.token_slots.view(store.num_groups, -1).unbind(0)
            groups = [
                HeadSequenceBatch(block_tables[g], seq_lens[g], layout.query_start_loc, slots[g])
                for g in range(store.num_groups)
            ]
            self._per_layer = [groups[tables.group_of(layer)] for layer in range(self.worker.num_layers)]
        return self._per_layer[layer_idx]

    # ----- decode-time cap ------------------------------------------------------------------------------
    def record_queries(self, layer_idx: int, query: torch.Tensor) -> None:
        """Keep the queries [T, Hq, D] of capped decoding requests (one batched write per layer)."""
        if self.ring_writes is not None and self.worker.decode is not None:
            self.worker.decode.record_queries(layer_idx, query, self.ring_writes)

    def rescore_layer(self, layer_idx: int, read_keys: KeyReader) -> DecodeMoves | None:
        """Re-score ``layer_idx`` of the requests whose cap re-scores in this step; the moves to make inside
        the layer's cache (None: none). Runs after the layer's attention (this step's token is cached)."""
        decode = self.worker.decode
        if not self.rescores or decode is None:
            return None
        started = time.perf_counter()
        worker = self.worker
        moves = decode.rescore_layer(layer_idx, self.rescores, self._block_table, read_keys, worker.check)
        if layer_idx == self.worker.num_layers - 1:
            self.worker.record_rescored(self.rescores)
        self.eviction_seconds += time.perf_counter() - started
        return moves

    # ----- per-chunk eviction ---------------------------------------------------------------------------
    def rescore_chunks(self, layer_idx: int, query: torch.Tensor, read_rows: RowReader) -> ChunkMoves | None:
        """Re-score ``layer_idx`` of the requests whose prompt chunk evicts in this step (and keep the queries
        of the other prefilling ones for a later window); the moves to make inside the layer's cache (None:
        none). query [T, Hq, D]; runs after the layer's attention (the chunk is cached)."""
        if not self.chunks:
            return None
        started = time.perf_counter()
        worker = self.worker
        moves, results = worker.chunks.rescore_layer(
            layer_idx,
            self.chunks,
            self._block_table,
            query,
            read_rows,
            worker.o_proj.get(layer_idx),
            worker.check,
        )
        for r, result in zip(self.chunks, results, strict=True):
            if result is None or not (r.final or worker.dump_dir is not None):
                continue
            self._chunk_kept.setdefault(r.req_id, []).append(result)
            record = worker.decode.records.get(r.req_id) if worker.decode is not None else None
            if r.final and record is not None and not r.trailing:  # the decode cap starts from the prompt's
                record.positions[layer_idx] = result.positions
        if layer_idx == worker.num_layers - 1:
            for r in self.chunks:
                if r.evicts:
                    worker.record_chunk(r, self._chunk_kept.pop(r.req_id, None))
        self.eviction_seconds += time.perf_counter() - started
        return moves

    # ----- compaction -----------------------------------------------------------------------------------
    def compact_layer(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> CompactionWrite | None:
        """Score and select this layer's kept tokens for every request compacting in this step and assign
        their sub-blocks. query [T, Hq, D], key/value [T, H, D] (post-RoPE, this step's rows).
        Returns the moves to make in the layer's cache (None when nothing compacts): every plan is a
        tensor on the cache's device; only host-known sizes are used to build it."""
        if not self.compacting:
            return None
        started = time.perf_counter()
        worker = self.worker
        writes: list[CompactionWrite] = []
        for req in self.compacting:
            plan = req.plan
            assert plan is not None and req.policy is not None
            if req.decode is not None:
                writes.append(self._compact_with_cap(req, layer_idx, query, key, value))
                continue
            prompt = slice(req.q_start, req.q_start + req.prompt_len)
            window = req.policy.query_window(req.prompt_len)
            layer = LayerKV(
                keys=key[prompt].transpose(0, 1),
                values=value[prompt].transpose(0, 1),
                queries=query[prompt.stop - window : prompt.stop].transpose(0, 1),
                layer_idx=layer_idx,
                num_layers=worker.num_layers,
                o_proj=worker.o_proj.get(layer_idx),
            )
            budget = plan.layer_budgets[layer_idx]
            kept = worker.select(layer, budget, req)
            trailing = req.q_len - req.prompt_len
            table = self._table_for(req, layer_idx, kept.counts, budget, trailing)
            writes.append(self._moves(req, kept, table, budget, trailing))
            record = worker.decode.records.get(req.req_id) if worker.decode is not None else None
            if record is not None:  # the decode cap starts from what the prompt kept
                record.positions[layer_idx] = kept.indices.to(torch.int64)
            if worker.tables.last_layer_of_group(layer_idx):
                worker.tables.commit(layer_idx, req.index, table, plan.blocks_to_free)
                del self._pending[(req.req_id, worker.tables.group_of(layer_idx))]
            self._finish_layer(req, layer_idx, kept)
        self.eviction_seconds += time.perf_counter() - started
        return CompactionWrite(
            torch.cat([w.tokens for w in writes]),
            torch.cat([w.heads for w in writes]),
            torch.cat([w.slots for w in writes]),
            torch.cat([w.src_slots for w in writes]),
        )

    def _finish_layer(self, req: StepRequest, layer_idx: int, kept: KeptTokens) -> None:
        """Bookkeeping of a compacted layer: kept prompt counts for the metrics, the debug dump, and the
        request's record once its last layer is done."""
        worker = self.worker
        self._kept_counts.setdefault(req.req_id, []).append(kept.counts)
        if worker.dump_dir is not None:
            self._kept_for_dump.setdefault(req.req_id, []).append(kept)
        if layer_idx == worker.num_layers - 1:
            worker.finish_compaction(req, self._kept_for_dump.pop(req.req_id, None))
            kept_per_head = torch.stack(self._kept_counts.pop(req.req_id)).tolist()  # once per request
            worker.record_compacted(req, kept_per_head)

    def _compact_with_cap(
        self, req: StepRequest, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> CompactionWrite:
        """A recomputed request whose decode cap already applies: the prompt's own selection (or the whole
        prompt when its plan keeps it), then the decode method over those entries and the recomputed output,
        down to ``a(t)``, compacted straight from this step's standard-layout slots."""
        worker, record, plan = self.worker, req.decode, req.plan
        assert record is not None and plan is not None and worker.decode is not None
        bs, heads = worker.block_size, worker.num_kv_heads
        prompt_len, generated = req.prompt_len, req.q_len - req.prompt_len
        start = req.q_start
        if plan.compacts:
            window = req.policy.query_window(prompt_len) if req.policy is not None else 0
            layer = LayerKV(
                keys=key[start : start + prompt_len].transpose(0, 1),
                values=value[start : start + prompt_len].transpose(0, 1),
                queries=query[start + prompt_len - window : start + prompt_len].transpose(0, 1),
                layer_idx=layer_idx,
                num_layers=worker.num_layers,
                o_proj=worker.o_proj.get(layer_idx),
            )
            kept = worker.select(layer, plan.layer_budgets[layer_idx], req)
        else:
            kept = KeptTokens.everything(heads, prompt_len, key.device)
        counts = kept.counts.to(device=key.device, dtype=torch.int64)
        width = (int(counts.max()) if kept.indices.numel() else 0) + generated
        j = torch.arange(width, device=key.device)
        from_prompt = kept.indices.to(key.device, torch.int64)
        if from_prompt.shape[1]:
            from_prompt = from_prompt.gather(1, j.clamp(max=from_prompt.shape[1] - 1).expand(heads, width))
        else:
            from_prompt = torch.zeros(heads, width, dtype=torch.int64, device=key.device)
        candidates = torch.where(j < counts[:, None], from_prompt, prompt_len + j - counts[:, None])
        candidates = torch.where(j < counts[:, None] + generated, candidates, -1)
        head_ids = torch.arange(heads, device=key.device)[:, None]
        keys = key[start + candidates.clamp(min=0), head_ids]  # [H, L, D]
        positions, lengths = worker.decode.compact_recomputed(
            layer_idx, record, candidates, keys, query[start : start + req.q_len], generated
        )
        first_block = plan.blocks_freed(generated)
        total = int(lengths.sum())
        table = worker.tables.store.assign(  # type: ignore[union-attr]
            lengths,
            self._block_table[req.index],
            first_block,
            0,
            total=total,
            num_blocks=cdiv(req.seq_len, bs),
            check=worker.check,
        )
        kept_heads, index = head_token_index(lengths, total)
        rows = positions[kept_heads, index] + start
        standard = self._slot_mapping[rows].to(torch.int64)
        src = ((standard // bs) * heads + kept_heads) * bs + standard % bs
        worker.tables.commit(layer_idx, req.index, table, first_block)
        self._finish_layer(req, layer_idx, kept)
        return CompactionWrite(rows, kept_heads, table.token_slots(bs, kept_heads, index), src)

    def _table_for(
        self, req: StepRequest, layer_idx: int, counts: torch.Tensor, budget: int, trailing: int
    ) -> TableRows:
        """The request's table for the group of ``layer_idx``: assigned at the group's first layer."""
        worker = self.worker
        key = (req.req_id, worker.tables.group_of(layer_idx))
        table = self._pending.get(key)
        if table is None:
            store = worker.tables.store
            assert req.plan is not None and store is not None
            table = store.assign(
                counts,
                self._block_table[req.index],
                req.plan.blocks_to_free,
                trailing,
                total=worker.num_kv_heads * budget,
                num_blocks=cdiv(req.seq_len, worker.block_size),
                check=worker.check,
            )
            self._pending[key] = table
        elif worker.check and not torch.equal(table.lengths.to(counts.dtype), counts + trailing):
            raise RuntimeError(
                f"policy {req.policy.name if req.policy else '?'} kept different per-head counts in layers "
                f"that share one sub-block table (layer {layer_idx}); it must not be treated as uniform"
            )
        return table

    def _moves(
        self, req: StepRequest, kept: KeptTokens, table: TableRows, budget: int, trailing: int
    ) -> CompactionWrite:
        """Kept entries of one request's layer: from its standard-layout slots (the prompt was written there
        in this step) to its sub-block slots, head-major, the trailing tokens after each head's kept ones."""
        worker = self.worker
        bs, num_heads = worker.block_size, worker.num_kv_heads
        per_head = kept.counts.to(torch.int64) + trailing
        heads, index = head_token_index(per_head, num_heads * (budget + trailing))
        counts = kept.counts.to(torch.int64)[heads]
        width = max(1, kept.indices.shape[1])
        indices = kept.indices.to(torch.int64)
        kept_index = indices[heads, index.clamp(max=width - 1)] if indices.numel() else index
        tokens = torch.where(index < counts, kept_index, req.prompt_len + index - counts)
        outside = (index < counts) & ((kept_index < 0) | (kept_index >= req.prompt_len))
        if worker.check and bool(outside.any()):  # a device read: CPU only
            raise ValueError(f"request {req.req_id}: kept indices must lie in [0, {req.prompt_len})")
        rows = tokens + req.q_start
        standard = self._slot_mapping[rows].to(torch.int64)  # vLLM's slot of each kept token
        src = ((standard // bs) * num_heads + heads) * bs + standard % bs
        return CompactionWrite(rows, heads, table.token_slots(bs, heads, index), src)


class EvictionWorker:
    """The one owner of eviction state in a worker process."""

    def __init__(
        self,
        policy: EvictionPolicy,
        budget: int | float,
        num_layers: int,
        num_kv_heads: int,
        block_size: int,
        config: EvictionConfig | None = None,
        max_num_seqs: int = 0,
    ) -> None:
        self.policy = policy
        self.budget = budget
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.requests: dict[str, RequestPlan] = {}  # compacted requests
        self.kept_tokens: dict[str, float] = {}  # req -> mean kept prompt entries per KV head (metrics)
        shared = shares_tables(policy)
        server = config if config is not None else EvictionConfig(policy.name, budget)
        # A decode cap re-scores each layer on its own: ragged across layers, one table group per layer.
        shared = shared and server.decode is None
        self.tables = BatchSubBlocks(num_layers, num_kv_heads, block_size, shared, max_num_seqs)
        self.chunks = ChunkEviction(num_layers, num_kv_heads, block_size, self.tables, server.between_rule)
        self._chunk_history: dict[str, list] = {}  # req -> held sets after each chunk (debug dump only)
        self.decode: DecodeEviction | None = None
        if server.decode is not None:
            self.decode = DecodeEviction(
                decode_policy(server.decode),
                server.decode.allocation,
                num_layers,
                num_kv_heads,
                block_size,
                self.tables,
                server.decode.interval,
            )
        self.check = True  # set per step from the cache's device (see make_step)
        self._kept_by_slot = np.zeros(0)  # [R] kept_tokens of each batch slot (nan: not compacted)
        self._metric_ids: list[str] | None = None
        self.o_proj: dict[int, torch.Tensor] = {}
        self.o_proj_collected = False  # collected once, after the model is loaded (empty unless CriticalKV)
        self.pending: StepInputs | None = None
        self._step: EvictionStep | None = None
        dump = os.environ.get(DEBUG_DUMP_ENV)
        self.dump_dir = Path(dump) if dump else None
        if self.decode is not None:
            self.decode.dump = self.dump_dir is not None

        # Per-request settings (vllm_xargs), resolved exactly like the scheduler's manager does.
        self.settings = RequestSettings(server, block_size, num_layers)
        self.plan_for = self.settings.plan_for

    # ----- called by the runner hooks -------------------------------------------------------------------
    def begin_step(self, inputs: StepInputs) -> None:
        self.pending = inputs
        self._step = None

    def end_step(self) -> None:
        if self._step is not None:
            self._publish_step_metrics(self._step)
        self.pending = None
        self._step = None

    def _publish_step_metrics(self, step: EvictionStep) -> None:
        if step.eviction_seconds > 0:
            metrics.observe_eviction_step(step.eviction_seconds)
        resident = np.nansum(self._kept_by_slot[: step.num_reqs] + step.seq_lens - step.prompt_lens)
        metrics.set_kv_tokens_resident(float(resident))

    def drop(self, req_ids: set[str] | list[str] | None) -> None:
        """Forget finished, aborted or preempted requests (their blocks go back through the scheduler)."""
        for req_id in req_ids or ():
            self.requests.pop(req_id, None)
            self.kept_tokens.pop(req_id, None)
            self.tables.forget(req_id)
            self.chunks.drop(req_id)
            self._chunk_history.pop(req_id, None)
            self._metric_ids = None
            if self.decode is not None:
                self.dump_decode(req_id)
                self.decode.drop(req_id)

    # ----- called by the metadata builder ---------------------------------------------------------------
    def make_step(
        self,
        num_reqs: int,
        num_tokens: int,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> EvictionStep | None:
        """The step's eviction data, or None when the batch is not a real scheduled step (dummy runs).

        block_table [R', W] / slot_mapping [T'] are vLLM's tensors on the cache's device (only read there).
        Python work is O(1) in the batch for decoding requests; requests whose prompt completes now are
        handled one by one (they are prefills)."""
        inputs = self.pending
        if inputs is None or len(inputs.req_ids) != num_reqs or int(inputs.scheduled.sum()) != num_tokens:
            return None
        if self._step is not None:
            # Tables grow once per step, however many builders ask.
            return self._step
        # Plans and pools are checked where reading the device is free; on a GPU the step never syncs.
        self.check = block_table.device.type == "cpu"
        computed = np.asarray(inputs.computed, dtype=np.int64)
        q_lens = np.asarray(inputs.scheduled, dtype=np.int64)
        prompt_lens = np.asarray(inputs.prompt_lens, dtype=np.int64)
        seq_lens_host = computed + q_lens
        self.tables.begin(inputs.req_ids, computed, block_table)
        if inputs.req_ids != self._metric_ids:
            self._kept_by_slot = np.array([self.kept_tokens.get(r, np.nan) for r in inputs.req_ids])
            self._metric_ids = list(inputs.req_ids)
        for slot in np.flatnonzero(computed == 0):
            # A request starting from scratch (new, or recomputed after preemption) has no old layout.
            self.requests.pop(inputs.req_ids[slot], None)
            self.kept_tokens.pop(inputs.req_ids[slot], None)
            self._kept_by_slot[slot] = np.nan
            self.chunks.drop(inputs.req_ids[slot])
            self._chunk_history.pop(inputs.req_ids[slot], None)
            if self.decode is not None:
                self.decode.restart(inputs.req_ids[slot])
        compacted = self.tables.compacted(num_reqs).copy()
        ring_writes, rescores = None, []
        if self.decode is not None:
            ring_writes, rescores = self.decode.plan_step(
                inputs.req_ids,
                computed,
                q_lens,
                compacted,
                lambda slot: self._setting_plan(inputs, slot, int(prompt_lens[slot]))[0],
                block_table.device,
            )
        q_start = np.cumsum(q_lens) - q_lens
        whole = ~compacted & (computed == 0) & (prompt_lens <= seq_lens_host)
        candidates = np.flatnonzero(whole)
        chunks = self._chunk_rescores(
            inputs,
            np.flatnonzero(~whole & (computed < prompt_lens)),
            compacted,
            computed,
            seq_lens_host,
            q_start,
            q_lens,
        )
        compacting: list[StepRequest] = []
        for index in candidates.tolist():
            req_id, prompt_len = inputs.req_ids[index], int(prompt_lens[index])
            req = StepRequest(
                index, req_id, int(q_start[index]), int(q_lens[index]), int(seq_lens_host[index]), prompt_len
            )
            plan, setting = self._setting_plan(inputs, index, prompt_len)
            req.policy = setting.policy if setting else self.policy
            generated = int(seq_lens_host[index]) - prompt_len
            record = self.decode.admit(req_id, plan) if self.decode is not None else None
            if record is not None and plan.offset(generated) != plan.offset0:
                # Recomputed after preemption with its decode cap already applied: evict to a(t) now.
                req.plan, req.decode = plan, record
                self.tables.split()
                compacting.append(req)
            elif not plan.compacts:
                metrics.record_request_skipped(setting.method if setting else self.policy.name)
            else:
                req.plan = plan
                if not shares_tables(req.policy):
                    self.tables.split()
                compacting.append(req)
        layout = None
        if compacted.any():
            layout = self.tables.layout(computed, q_lens, block_table, self.check)
        else:
            self.tables.skip(num_reqs)
        self._step = EvictionStep(
            self,
            compacting,
            block_table,
            slot_mapping,
            num_reqs,
            num_tokens,
            layout,
            max_seq_len=int(seq_lens_host.max(initial=0)),
            max_query_len=int(q_lens.max(initial=0)),
            seq_lens=seq_lens_host,
            prompt_lens=prompt_lens,
            ring_writes=ring_writes,
            rescores=rescores,
            chunks=chunks,
        )
        return self._step

    def _chunk_rescores(
        self,
        inputs: StepInputs,
        prefilling: np.ndarray,
        compacted: np.ndarray,
        computed: np.ndarray,
        seq_lens: np.ndarray,
        q_start: np.ndarray,
        q_lens: np.ndarray,
    ) -> list[ChunkRescore]:
        """Requests prefilling in this step without their whole prompt in it (a later chunk, or a first step
        that does not start at token 0) whose rule evicts now: after a chunk that moves the offset, or when
        the prompt completes and its plan compacts. Python work per prefilling request."""
        chunks: list[ChunkRescore] = []
        for index in prefilling.tolist():
            prompt_len = int(inputs.prompt_lens[index])
            plan, setting = self._setting_plan(inputs, index, prompt_len)
            n0, n1 = int(computed[index]), int(seq_lens[index])
            completes = n1 >= prompt_len
            if completes and not plan.compacts:
                metrics.record_request_skipped(setting.method if setting else self.policy.name)
            if not plan.compacts:
                continue
            evicts = completes or plan.chunk_rescores(n0, n1)
            policy = setting.policy if setting else self.policy
            assert policy is not None
            if completes and not shares_tables(policy):
                self.tables.split()
            if completes and self.decode is not None:
                self.decode.admit(inputs.req_ids[index], plan)
            chunks.append(
                ChunkRescore(
                    index,
                    inputs.req_ids[index],
                    int(q_start[index]),
                    int(q_lens[index]),
                    n0,
                    n1,
                    plan,
                    policy,
                    bool(compacted[index]),
                    evicts,
                )
            )
        return chunks

    def _setting_plan(self, inputs: StepInputs, slot: int, prompt_len: int):
        """(plan, per-request setting or None) of the request in ``slot``."""
        setting = self.settings.resolve(inputs.extra_args[slot] if inputs.extra_args else None)
        return (setting.plan_for if setting else self.plan_for)(prompt_len), setting

    def layer_table(self, req_id: str, layer_idx: int) -> SubBlockTable:
        """A compacted request's table for ``layer_idx`` as the reference model (inspection and tests)."""
        return self.tables.table_of(req_id, layer_idx)

    # ----- called by the step ---------------------------------------------------------------------------
    def select(self, layer: LayerKV, budget: int, req: StepRequest) -> KeptTokens:
        """The policy's kept tokens, checked against the accounting (exactly H x budget, within the prompt).

        The scheduler frees the request's blocks whatever happens here, so a policy failure must still
        compact: it is logged and the layer keeps the most recent ``budget`` tokens of every head instead
        of taking the engine down."""
        try:
            kept = guarded_select(req.policy, layer, budget)  # any policy failure -> a counted PolicyFault
            if kept.total == self.num_kv_heads * budget and int(kept.counts.max()) <= req.prompt_len:
                return kept
            problem = f"kept {kept.counts.tolist()} tokens per head, the accounting needs {budget} on average"
        except (ValueError, RuntimeError) as exc:
            problem = str(exc)
        logger.error(
            "policy %r failed on request %s layer %d (%s); keeping its most recent %d tokens per head",
            req.policy.name,
            req.req_id,
            layer.layer_idx,
            problem,
            budget,
        )
        recent = torch.arange(req.prompt_len - budget, req.prompt_len)
        return KeptTokens(
            indices=recent.expand(self.num_kv_heads, budget).contiguous(),
            counts=torch.full((self.num_kv_heads,), budget, dtype=torch.int64),
        )

    def record_rescored(self, rescores: list[Rescore]) -> None:
        """Every layer of ``rescores`` was re-scored: their resident entries per head are now a(t)."""
        for r in rescores:
            plan = r.record.plan
            self.requests[r.req_id] = plan
            # resident = kept + generated (see _publish_step_metrics): a(t) after the re-score.
            self.kept_tokens[r.req_id] = float(plan.kept_length(r.generated) - r.generated)
            self._kept_by_slot[r.slot] = self.kept_tokens[r.req_id]

    def dump_decode(self, req_id: str) -> None:
        """Save a finished capped request's per-head lengths before each re-score (debug dump only)."""
        if self.dump_dir is None or self.decode is None:
            return
        record = self.decode.dump_record(req_id)
        if record is None:
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in req_id)
        torch.save(record, self.dump_dir / f"{safe}.decode.pt")

    def record_chunk(self, r: ChunkRescore, kept: list[LayerResult] | None) -> None:
        """Every layer of ``r`` was re-scored after its chunk: publish (metrics, debug dump)."""
        if not r.final:
            if kept is not None:  # debug dump: what each head holds after this chunk
                history = self._chunk_history.setdefault(r.req_id, [])
                history.append((r.seq_len, [(k.positions.cpu(), k.counts.cpu()) for k in kept]))
            held = r.plan.kept_length_at(r.seq_len)
            # resident = kept + (seq_len - prompt_len) in _publish_step_metrics: the held entries here.
            self.kept_tokens[r.req_id] = float(held + r.plan.prompt_len - r.seq_len)
            self._kept_by_slot[r.slot] = self.kept_tokens[r.req_id]
            return
        assert kept is not None
        prompt_counts = [(result.counts - r.trailing).tolist() for result in kept]
        self.kept_tokens[r.req_id] = sum(map(sum, prompt_counts)) / (len(prompt_counts) * self.num_kv_heads)
        self._kept_by_slot[r.slot] = self.kept_tokens[r.req_id]
        self.requests[r.req_id] = r.plan
        metrics.record_kept_per_head(r.policy.name, r.plan.prompt_len, prompt_counts, r.plan.blocks_to_free)
        if self.dump_dir is not None:
            as_kept = [KeptTokens(result.positions.cpu(), result.counts.cpu()) for result in kept]
            self.finish_compaction(
                StepRequest(r.slot, r.req_id, r.q_start, r.q_len, r.seq_len, r.plan.prompt_len), as_kept
            )

    def record_compacted(self, req: StepRequest, kept_per_head: list[list[int]]) -> None:
        """Publish a request's compaction (metrics.py): kept counts [layer][kv head], blocks freed."""
        assert req.plan is not None
        self.kept_tokens[req.req_id] = sum(map(sum, kept_per_head)) / (len(kept_per_head) * self.num_kv_heads)
        if req.decode is not None:  # compacted straight to its decode cap: a(t) resident
            generated = req.seq_len - req.prompt_len
            self.kept_tokens[req.req_id] = float(req.plan.kept_length(generated) - generated)
        self._kept_by_slot[req.index] = self.kept_tokens[req.req_id]
        self.requests[req.req_id] = req.plan
        self.tables.mark_compacted(req.index)
        metrics.record_kept_per_head(req.policy.name, req.prompt_len, kept_per_head, req.plan.blocks_to_free)

    def finish_compaction(self, req: StepRequest, kept: list[KeptTokens] | None) -> None:
        """The last layer of ``req`` is compacted: record it (debug dump when enabled). ``chunks``: for a
        prompt evicted between chunks, (computed tokens, per layer (positions [H, M] -1 padded, counts [H]))
        after each such chunk."""
        history = self._chunk_history.pop(req.req_id, [])
        if self.dump_dir is None or kept is None:
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "req_id": req.req_id,
            "prompt_len": req.prompt_len,
            "indices": [k.indices.cpu() for k in kept],
            "counts": [k.counts.cpu() for k in kept],
            "chunks": history,
        }
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in req.req_id)
        torch.save(record, self.dump_dir / f"{safe}.pt")


def shares_tables(policy: EvictionPolicy | None) -> bool:
    """True when every layer of a request keeps the same count per head (uniform top-k per head with the
    default per-layer budget), so one sub-block table serves all its layers."""
    return isinstance(policy, ScoredPolicy) and type(policy).layer_budget is EvictionPolicy.layer_budget


_WORKER: EvictionWorker | None = None


def current_worker() -> EvictionWorker | None:
    """This process's eviction worker (None until a builder with eviction on created it)."""
    return _WORKER


def set_worker(worker: EvictionWorker | None) -> None:
    global _WORKER
    _WORKER = worker
