"""The one owner of eviction state in a worker process: the policy and per-request settings, the sub-block
tables, the per-chunk and decode-time state, the records, and CriticalKV's o_proj weights. The model
runner's metadata builders hold it, and the runner for its hooks (``vllm_adapter/evicting_backend.py``).
The model-runner hooks hand it each step's request ids and token counts (``begin_step``/``end_step``/
``drop``); the attention metadata builder asks it for the step (``make_step``), which every attention
layer of that step reads."""

from __future__ import annotations

import numpy as np
import torch

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.chat_marks import ChatMarks
from vllm_kvevict.datapath.chunk_eviction import ChunkEviction
from vllm_kvevict.datapath.decode_rescore import DecodeEviction
from vllm_kvevict.datapath.decode_schedule import Rescore
from vllm_kvevict.datapath.kept_contexts import KeptContexts
from vllm_kvevict.datapath.query_ring import RingWrites
from vllm_kvevict.datapath.question_echo import QuestionEcho
from vllm_kvevict.datapath.records import EvictionRecords
from vllm_kvevict.datapath.request_plans import RequestPlans
from vllm_kvevict.datapath.step import EvictionStep, WorkerParts, build_step
from vllm_kvevict.datapath.step_inputs import StepInputs
from vllm_kvevict.datapath.step_plan import PlannerView, StepDecisions, StepPlanner, shares_tables
from vllm_kvevict.layout.accounting import RequestPlan
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.policies.base import EvictionPolicy, keeps_equal_counts
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.request_settings import RequestSettings, decode_policy


class EvictionWorker:
    """The one owner of eviction state in a worker process."""

    def __init__(
        self,
        policy: EvictionPolicy,
        config: EvictionConfig,
        num_layers: int,
        num_kv_heads: int,
        block_size: int,
        max_num_seqs: int = 0,
        spare_columns: int = 0,
        layer_blocks: int = 0,
    ) -> None:
        self.policy = policy
        self.shape = CacheShape(num_layers, num_kv_heads, block_size)
        #: block-table columns for spare blocks (``EvictingAttentionSpec.spare_columns``; 0: never given)
        self.spare_columns = spare_columns
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        # A decode cap re-scores each layer on its own: ragged across layers, one table group per layer.
        # So does a budget pooled across layers, whose store needs the blocks per layer (vLLM's pool size).
        pooled = config.pools_layers
        if pooled and layer_blocks <= 0:
            raise ValueError(f"budget_scope 'model' needs the cache's blocks per layer, got {layer_blocks}")
        shared = shares_tables(policy) and config.decode is None and not pooled
        self.tables = BatchSubBlocks(
            num_layers, num_kv_heads, block_size, shared, max_num_seqs, layer_blocks if pooled else 0
        )
        self.chunks = ChunkEviction(self.shape, self.tables, config.between_rule)
        self.decode: DecodeEviction | None = None
        if config.decode is not None:
            self.decode = DecodeEviction(
                decode_policy(config.decode),
                config.decode.allocation,
                self.shape,
                self.tables,
                config.decode.interval,
            )
        self.records = EvictionRecords(num_kv_heads)
        if self.decode is not None:
            self.decode.dump = self.records.dump_dir is not None
        self.o_proj: dict[int, torch.Tensor] = {}
        self.o_proj_collected = False  # collected once, after the model is loaded (empty unless CriticalKV)
        self.contexts = KeptContexts(self.tables, self.records, num_layers)  # layout/context_reuse.py
        self.context_lens, self.context_readers = self.contexts.lens, self.contexts.readers
        self.entry_counts = self.contexts.entry_counts
        self._block_table: torch.Tensor | None = None  # this step's (for the creators' entry blocks)
        #: echoed tokens per question span (config ``question_echo``; 0: off unless a request asks) and the
        #: echo once the served tokenizer's marks are known (``use_chat_marks``)
        self.echo_width = config.question_echo or 0
        self.echo_between_chunks = config.echo_between_chunks
        self.echo: QuestionEcho | None = None
        self._seen_ids: list[str] = []
        self.pending: StepInputs | None = None
        self._step: EvictionStep | None = None
        # Per-request settings (vllm_xargs), resolved exactly like the scheduler's manager does.
        self.settings = RequestSettings(config, block_size, num_layers)
        self.plan_for = self.settings.plan_for
        self.plans = RequestPlans(self.settings, block_size, num_layers)
        #: request -> prompt tokens it found in vLLM's prefix cache (its computed tokens when first seen)
        self.shared_tokens = self.plans.shared_tokens

    @property
    def requests(self) -> dict[str, RequestPlan]:
        """Plans of the compacted requests."""
        return self.records.requests

    @property
    def kept_tokens(self) -> dict[str, float]:
        """Mean kept prompt entries per KV head of each compacted request (metrics)."""
        return self.records.kept_tokens

    # ----- called by the runner hooks -------------------------------------------------------------------
    def begin_step(self, inputs: StepInputs) -> None:
        self._step = None
        if inputs.req_ids != self._seen_ids:  # requests arrived (a steady batch compares one list)
            computed = np.asarray(inputs.computed).tolist()
            for slot, req_id in enumerate(inputs.req_ids):
                if req_id not in self.shared_tokens:
                    self.shared_tokens[req_id] = int(computed[slot])
                    self._note_context(inputs, slot)
            self._seen_ids = list(inputs.req_ids)
        self.pending = self.contexts.as_seen(inputs)  # a creator's prompt, as eviction sees it: its context

    def _note_context(self, inputs: StepInputs, slot: int) -> None:
        """A request seen for the first time that asked ``kv_context: "keep"``: a reader when it starts with
        computed tokens (only a kept context gives it any), else a creator."""
        setting = self.settings.resolve(inputs.extra_args[slot] if inputs.extra_args else None)
        if setting is None or not setting.keeps_context:
            return
        req_id = inputs.req_ids[slot]
        ragged = not keeps_equal_counts(setting.policy)
        prompt_len = int(inputs.prompt_lens[slot])
        self.contexts.note(req_id, self.shared_tokens[req_id], prompt_len, setting.plan_for, ragged)

    def use_chat_marks(self, marks: ChatMarks) -> None:
        """Start the question echo with the served tokenizer's marks (``chat_marks``: its user header, default
        system message and BOS; empty marks: every prompt is echoed by its head)."""
        self.echo = QuestionEcho(self.echo_width, marks, self.echo_between_chunks)

    def current_step(self) -> EvictionStep | None:
        """This step's eviction data (None before the metadata builder made it, or for a dummy run)."""
        return self._step

    def end_step(self) -> None:
        """The step is over: commit what its compacted prompts kept for their decode caps; publish."""
        if self._step is not None:
            if self.decode is not None:
                self.decode.start_from(self._step.cap_starts, self.records.requests)
            self._step.publish()
            if self.contexts.ragged_creators:
                assert self.pending is not None and self._block_table is not None
                self.contexts.record_entries(self.pending.req_ids, self._block_table)
        self.pending = None
        self._step = None
        self._block_table = None

    def drop(self, req_ids: set[str] | list[str] | None) -> None:
        """Forget finished, aborted or preempted requests (their blocks go back through the scheduler)."""
        for req_id in req_ids or ():
            self.shared_tokens.pop(req_id, None)
            self.contexts.drop(req_id)
            self.records.drop(req_id)
            self.tables.forget(req_id)
            self.chunks.drop(req_id)
            if self.decode is not None:
                self.records.dump_decode(req_id, self.decode.dump_record(req_id))
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
        """The step's eviction data, or None when the batch is not a real scheduled step (dummy runs). Built
        once per step, however many builders ask. block_table [R', W] / slot_mapping [T'] are vLLM's tensors
        on the cache's device."""
        inputs = self.pending
        if inputs is None or len(inputs.req_ids) != num_reqs or int(inputs.scheduled.sum()) != num_tokens:
            return None
        if self._step is None:
            self._block_table = block_table
            check = block_table.device.type == "cpu"
            self._start_step(inputs, block_table, check)
            view = PlannerView(
                self.shape,
                self.policy,
                self.plans,
                self.chunks,
                self.tables.compacted(num_reqs).copy(),
                self.decode is not None,
                self.echo,
                self.spare_columns,
            )
            decided = StepPlanner(view).plan(inputs)
            self._step = self._prepare(decided, inputs, block_table, slot_mapping, check)
        return self._step

    def _start_step(self, inputs: StepInputs, block_table: torch.Tensor, check: bool) -> None:
        """The worker's own state at the start of a step: the batch's tables and records in its order,
        requests computing from token 0 restarted, readers of a kept context set up."""
        computed = np.asarray(inputs.computed, dtype=np.int64)
        self.tables.begin(inputs.req_ids, computed, block_table)
        self.records.align(inputs.req_ids)
        for slot in np.flatnonzero(computed == 0).tolist():
            self._restart(slot, inputs.req_ids[slot])
        if self.contexts.readers:
            self.contexts.start_readers(inputs.req_ids, block_table, check)

    def _restart(self, slot: int, req_id: str) -> None:
        """A request starting from scratch (new, or recomputed after preemption) has no old layout."""
        self.records.restart(slot, req_id)
        self.chunks.drop(req_id)
        if self.decode is not None:
            self.decode.restart(req_id)

    def _prepare(
        self,
        decided: StepDecisions,
        inputs: StepInputs,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        check: bool,
    ) -> EvictionStep:
        """Apply what the planner decided the worker's state needs before the step's layers run: the decode
        schedule's ring writes and re-scores, caps admitted, one table group per layer where a request keeps
        ragged counts, requests compacting nothing recorded, every row grown by the step's tokens when some
        request reads a compacted cache; then build the step (``step.build_step``)."""
        decode_work: tuple[RingWrites | None, list[Rescore]] = (None, [])
        if self.decode is not None:
            decode_work = self.decode.plan_step(
                inputs.req_ids,
                decided.computed,
                decided.q_lens,
                decided.compacted,
                lambda slot: self.plans.plan_of(inputs, slot, int(decided.prompt_lens[slot]))[0],
                block_table.device,
            )
            for req_id, plan in decided.admits:
                self.decode.admit(req_id, plan)
            for req in decided.capped_prompts:
                req.decode = self.decode.records[req.req_id]
        if decided.split_tables:
            self.tables.split()
        for method in decided.skipped:
            self.records.skipped(method)
        layout = None
        if decided.compacted.any():
            layout = self.tables.layout(decided.computed, decided.q_lens, block_table, check)
        else:
            self.tables.skip(len(inputs.req_ids))
        parts = WorkerParts(self.shape, self.tables, self.chunks, self.decode, self.records, self.o_proj)
        return build_step(decided, layout, decode_work, parts, block_table, slot_mapping)
