"""Worker-side orchestration of eviction, one step at a time (device-agnostic; kernels live in the backends).

``EvictionWorker`` is the single owner of sub-block state on a worker: which requests are compacted, their
``RequestSubBlocks``, the policy, and the o_proj weights CriticalKV needs. The model-runner hooks
(``runner_hooks.py``) hand it each step's request ids and token counts; the attention metadata builder turns
them into an ``EvictionStep``, which every attention layer of that step reads:

- requests compacted in an earlier step get room for this step's tokens in each of their tables, and the
  step exposes, per layer, a ``HeadSequenceBatch``: the batch reshaped so each (request, KV head) is one
  sequence with its own sub-block table row and length ("head as sequence"); requests still in the
  standard layout appear there with sub-blocks ``block * H + h`` and the full length;
- requests whose prompt completes in this step and whose plan compacts are scored and compacted layer by
  layer, right after that layer's attention, from the keys/values/queries the layer has in hand.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vllm_kvevict.layout.accounting import RequestPlan, cdiv, request_planner
from vllm_kvevict.layout.compaction import CompactionPlan, plan_compaction
from vllm_kvevict.layout.subblock_table import RequestSubBlocks, SubBlockTable
from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens, LayerKV
from vllm_kvevict.vllm_adapter import metrics
from vllm_kvevict.vllm_adapter.config import EvictionConfig
from vllm_kvevict.vllm_adapter.policy_guard import guarded_select
from vllm_kvevict.vllm_adapter.request_settings import RequestSettings

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
    subblocks: RequestSubBlocks | None = None  # compacted in an earlier step
    plan: RequestPlan | None = None  # compacts in this step
    policy: EvictionPolicy | None = None  # the request's policy when it compacts in this step
    new_slots: dict[int, torch.Tensor] = field(default_factory=dict)  # id(table) -> [q_len, H] slots


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
    """Rows of the step's key/value tensors to write into the one-head view: ``key[tokens, heads]`` goes to
    ``slots`` (all [K] int64)."""

    tokens: torch.Tensor
    heads: torch.Tensor
    slots: torch.Tensor


class EvictionStep:
    """Per-step eviction data shared by every attention layer of the step (built once by the builder)."""

    def __init__(
        self,
        worker: EvictionWorker,
        requests: list[StepRequest],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
    ) -> None:
        self.worker = worker
        self.requests = requests
        self.num_tokens = num_tokens
        self.compacted = [r for r in requests if r.subblocks is not None]
        self.compacting = [r for r in requests if r.plan is not None]
        self._block_table = block_table
        self._slot_mapping = slot_mapping
        self._batches: dict[tuple[int, ...], HeadSequenceBatch] = {}
        self._rows: torch.Tensor | None = None
        self._kept_for_dump: dict[str, list[KeptTokens]] = {}
        self._kept_counts: dict[str, list[list[int]]] = {}  # req -> [layer][kv head] kept, for metrics
        self.eviction_seconds = 0.0  # scoring, selection and compaction planning in this step

    @property
    def has_compacted(self) -> bool:
        """True when some request reads a compacted cache: the whole batch then runs head-as-sequence."""
        return bool(self.compacted)

    # ----- head as sequence -----------------------------------------------------------------------------
    def sequence_rows(self) -> torch.Tensor | None:
        """[T*H] int64 ``token * H + head`` of each row of the head-as-sequence query (sequence r*H + h, then
        the request's tokens), indexing ``query.reshape(T*H, g, D)``; None when every request has one token
        this step (pure decode): the order is then the identity and no gather is needed."""
        if all(req.q_len == 1 for req in self.requests):
            return None
        if self._rows is None:
            heads = self.worker.num_kv_heads
            rows = []
            for req in self.requests:
                tokens = torch.arange(req.q_start, req.q_start + req.q_len, dtype=torch.int64)
                rows.append((tokens[None, :] * heads + torch.arange(heads)[:, None]).reshape(-1))
            self._rows = torch.cat(rows)
        return self._rows

    def head_batch(self, layer_idx: int) -> HeadSequenceBatch:
        """The head-as-sequence view of the batch for ``layer_idx`` (shared by layers with equal tables)."""
        tables = [req.subblocks.layer_tables[layer_idx] for req in self.compacted]  # type: ignore[union-attr]
        key = tuple(id(t) for t in tables)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._build_head_batch(tables)  # type: ignore[arg-type]
            self._batches[key] = batch
        return batch

    def _build_head_batch(self, tables: list[SubBlockTable]) -> HeadSequenceBatch:
        worker = self.worker
        heads, bs = worker.num_kv_heads, worker.block_size
        num_reqs = len(self.requests)
        head_ids = torch.arange(heads, dtype=torch.int64)
        blocks = self._block_table[:num_reqs].to(torch.int64)
        width = max([blocks.shape[1]] + [len(sb) for t in tables for sb in t.subblocks])
        block_table = torch.zeros((num_reqs, heads, width), dtype=torch.int64)
        # Standard layout: head h of block b is sub-block b*H + h.
        block_table[:, :, : blocks.shape[1]] = blocks[:, None, :] * heads + head_ids[None, :, None]
        seq_lens = torch.tensor([r.seq_len for r in self.requests], dtype=torch.int64)
        seq_lens = seq_lens[:, None].repeat(1, heads)

        slots = self._slot_mapping[: self.num_tokens].to(torch.int64)
        std_slots = ((slots // bs)[:, None] * heads + head_ids[None, :]) * bs + (slots % bs)[:, None]
        slot_mapping = torch.where(slots[:, None] < 0, -1, std_slots)

        for req, table in zip(self.compacted, tables, strict=True):
            for h in range(heads):
                block_table[req.index, h, : len(table.subblocks[h])] = torch.tensor(table.subblocks[h])
                seq_lens[req.index, h] = table.lengths[h]
            slot_mapping[req.q_start : req.q_start + req.q_len] = req.new_slots[id(table)]

        q_lens = torch.tensor([r.q_len for r in self.requests], dtype=torch.int64).repeat_interleave(heads)
        query_start_loc = torch.zeros(num_reqs * heads + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(q_lens, 0)
        return HeadSequenceBatch(
            block_table=block_table.reshape(num_reqs * heads, width).to(torch.int32),
            seq_lens=seq_lens.reshape(-1).to(torch.int32),
            query_start_loc=query_start_loc,
            slot_mapping=slot_mapping.reshape(-1),
        )

    # ----- compaction -----------------------------------------------------------------------------------
    def compact_layer(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> CompactionWrite | None:
        """Score and select this layer's kept tokens for every request compacting in this step and assign
        their sub-blocks. query [T, Hq, D], key/value [T, H, D] (post-RoPE, this step's rows).
        Returns the rows to write (None when nothing compacts)."""
        if not self.compacting:
            return None
        started = time.perf_counter()
        worker = self.worker
        writes: list[CompactionWrite] = []
        for req in self.compacting:
            plan = req.plan
            assert plan is not None
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
            subblocks = worker.subblocks_for(req, self._block_table[req.index])
            trailing = req.q_len - req.prompt_len
            counts = kept.counts.tolist()
            self._kept_counts.setdefault(req.req_id, []).append(counts)
            table = subblocks.compact_layer(layer_idx, counts, trailing)
            plan_rows: CompactionPlan = plan_compaction(
                kept.indices, kept.counts, table, req.prompt_len, trailing
            )
            writes.append(
                CompactionWrite(plan_rows.src_tokens + req.q_start, plan_rows.src_heads, plan_rows.dst_slots)
            )
            if worker.dump_dir is not None:
                self._kept_for_dump.setdefault(req.req_id, []).append(kept)
            if layer_idx == worker.num_layers - 1:
                worker.finish_compaction(req, self._kept_for_dump.pop(req.req_id, None))
                worker.record_compacted(req, self._kept_counts.pop(req.req_id))
        self.eviction_seconds += time.perf_counter() - started
        return CompactionWrite(
            torch.cat([w.tokens for w in writes]),
            torch.cat([w.heads for w in writes]),
            torch.cat([w.slots for w in writes]),
        )


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
    ) -> None:
        self.policy = policy
        self.budget = budget
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.requests: dict[str, RequestSubBlocks] = {}
        self.kept_tokens: dict[str, float] = {}  # req -> mean kept prompt entries per KV head (metrics)
        self.o_proj: dict[int, torch.Tensor] = {}
        self.o_proj_collected = False  # collected once, after the model is loaded (empty unless CriticalKV)
        self.pending: StepInputs | None = None
        self._step: EvictionStep | None = None
        dump = os.environ.get(DEBUG_DUMP_ENV)
        self.dump_dir = Path(dump) if dump else None

        self.plan_for = request_planner(budget, block_size, policy, num_layers)
        # Per-request settings (vllm_xargs), resolved exactly like the scheduler's manager does.
        server = config if config is not None else EvictionConfig(policy.name, budget)
        self.settings = RequestSettings(server, block_size, num_layers)

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
        resident = sum(
            self.kept_tokens[req.req_id] + req.seq_len - req.prompt_len
            for req in step.requests if req.req_id in self.kept_tokens
        )
        metrics.set_kv_tokens_resident(resident)

    def drop(self, req_ids: set[str] | list[str] | None) -> None:
        """Forget finished, aborted or preempted requests (their blocks go back through the scheduler)."""
        for req_id in req_ids or ():
            self.requests.pop(req_id, None)
            self.kept_tokens.pop(req_id, None)

    # ----- called by the metadata builder ---------------------------------------------------------------
    def make_step(
        self, num_reqs: int, num_tokens: int, seq_lens: torch.Tensor, block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> EvictionStep | None:
        """The step's eviction data, or None when the batch is not a real scheduled step (dummy runs)."""
        inputs = self.pending
        if inputs is None or len(inputs.req_ids) != num_reqs or int(inputs.scheduled.sum()) != num_tokens:
            return None
        if self._step is not None:
            # Tables grow once per step, however many builders ask.
            return self._step
        requests: list[StepRequest] = []
        q_start = 0
        for index, req_id in enumerate(inputs.req_ids):
            computed, q_len = int(inputs.computed[index]), int(inputs.scheduled[index])
            prompt_len = int(inputs.prompt_lens[index])
            req = StepRequest(index, req_id, q_start, q_len, computed + q_len, prompt_len)
            q_start += q_len
            if computed == 0:
                # A request starting from scratch (new, or recomputed after preemption) has no old layout.
                self.requests.pop(req_id, None)
                self.kept_tokens.pop(req_id, None)
            subblocks = self.requests.get(req_id)
            if subblocks is not None:
                if not subblocks.fully_compacted:
                    raise RuntimeError(f"request {req_id} was left half-compacted by an earlier step")
                subblocks.sync_blocks(block_table[index].tolist(), cdiv(req.seq_len, self.block_size))
                req.subblocks = subblocks
                req.new_slots = subblocks.append(q_len)
            elif computed < prompt_len <= computed + q_len:
                setting = self.settings.resolve(inputs.extra_args[index] if inputs.extra_args else None)
                plan = (setting.plan_for if setting else self.plan_for)(prompt_len)
                req.policy = setting.policy if setting else self.policy
                if not plan.compacts:
                    metrics.record_request_skipped(setting.method if setting else self.policy.name)
                elif computed != 0:
                    raise RuntimeError(
                        f"request {req_id}: its prompt completes in a step starting at token {computed}; "
                        "eviction needs the whole prompt in one step (no prefix caching/chunked prefill)"
                    )
                else:
                    req.plan = plan
            requests.append(req)
        self._step = EvictionStep(self, requests, block_table, slot_mapping, num_tokens)
        return self._step

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
            req.policy.name, req.req_id, layer.layer_idx, problem, budget,
        )
        recent = torch.arange(req.prompt_len - budget, req.prompt_len)
        return KeptTokens(
            indices=recent.expand(self.num_kv_heads, budget).contiguous(),
            counts=torch.full((self.num_kv_heads,), budget, dtype=torch.int64),
        )

    def subblocks_for(self, req: StepRequest, block_row: torch.Tensor) -> RequestSubBlocks:
        """The request's sub-block owner, created at its first compacted layer from blocks [s, n)."""
        subblocks = self.requests.get(req.req_id)
        if subblocks is None:
            assert req.plan is not None
            first = req.plan.blocks_to_free
            num_blocks = cdiv(req.seq_len, self.block_size)
            blocks = block_row[first:num_blocks].tolist()
            subblocks = RequestSubBlocks(self.num_layers, self.num_kv_heads, self.block_size, first, blocks)
            self.requests[req.req_id] = subblocks
        return subblocks

    def record_compacted(self, req: StepRequest, kept_per_head: list[list[int]]) -> None:
        """Publish a request's compaction (metrics.py): kept counts [layer][kv head], blocks freed."""
        assert req.plan is not None
        self.kept_tokens[req.req_id] = sum(map(sum, kept_per_head)) / (len(kept_per_head) * self.num_kv_heads)
        metrics.record_kept_per_head(req.policy.name, req.prompt_len, kept_per_head, req.plan.blocks_to_free)

    def finish_compaction(self, req: StepRequest, kept: list[KeptTokens] | None) -> None:
        """The last layer of ``req`` is compacted: record it (debug dump when enabled)."""
        if self.dump_dir is None or kept is None:
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "req_id": req.req_id,
            "prompt_len": req.prompt_len,
            "indices": [k.indices.cpu() for k in kept],
            "counts": [k.counts.cpu() for k in kept],
        }
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in req.req_id)
        torch.save(record, self.dump_dir / f"{safe}.pt")


_WORKER: EvictionWorker | None = None


def current_worker() -> EvictionWorker | None:
    """This process's eviction worker (None until a builder with eviction on created it)."""
    return _WORKER


def set_worker(worker: EvictionWorker | None) -> None:
    global _WORKER
    _WORKER = worker
