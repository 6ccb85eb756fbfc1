"""Planning one engine step: from what the model runner knows (request ids, prompt lengths, token counts)
to which requests compact their whole prompt, which are re-scored after a chunk, which decode caps
re-score, and whether the batch runs head-as-sequence. Python work is O(1) in the batch for decoding
requests; requests whose prompt completes or arrives in chunks are handled one by one (they are prefills).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_kvevict.datapath.attention_metadata import HeadBatchBuilder, StepSizes
from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.chunk_eviction import ChunkEviction, ChunkRescore
from vllm_kvevict.datapath.decode_rescore import DecodeEviction
from vllm_kvevict.datapath.decode_schedule import CapStarts
from vllm_kvevict.datapath.layer_eviction import LayerTables
from vllm_kvevict.datapath.prompt_eviction import PromptEviction
from vllm_kvevict.datapath.question_echo import EchoPass, EchoRequest, QuestionEcho
from vllm_kvevict.datapath.records import EvictionRecords, StepTimer
from vllm_kvevict.datapath.request_plans import RequestPlans
from vllm_kvevict.datapath.step import EvictionStep, StepTools, StepWork
from vllm_kvevict.datapath.step_inputs import StepInputs, StepRequest
from vllm_kvevict.layout.accounting import RequestPlan
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.shared_prefix import spare_blocks, spare_blocks_seen
from vllm_kvevict.policies.base import EvictionPolicy, keeps_equal_counts
from vllm_kvevict.policies.between_chunks import WINDOW_KINDS

if TYPE_CHECKING:
    from vllm_kvevict.settings.request_settings import ResolvedSetting


class StepPlanner:
    """Builds each step's ``EvictionStep`` from the worker's collaborators (it owns no state of its own).
    The worker has set up the step's tables and restarted the requests computing from token 0 before."""

    def __init__(
        self,
        shape: CacheShape,
        policy: EvictionPolicy,
        tables: BatchSubBlocks,
        chunks: ChunkEviction,
        decode: DecodeEviction | None,
        records: EvictionRecords,
        plans: RequestPlans,
        echo: QuestionEcho | None = None,
        spare_columns: int = 0,
    ) -> None:
        self.shape = shape
        self.policy = policy
        self.tables = tables
        self.chunks = chunks
        self.decode = decode
        self.records = records
        self.plans = plans  # each request's plan and setting (read only)
        self.echo = echo  # the question echo (None: off)
        self.spare_columns = spare_columns  # block-table columns for spare blocks (0: never given)

    def plan(
        self,
        inputs: StepInputs,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        o_proj: dict[int, torch.Tensor],
    ) -> EvictionStep:
        """The step's eviction data. block_table [R', W] / slot_mapping [T'] are vLLM's tensors on the cache's
        device (only read there); plans and pools are checked where reading the device is free (CPU)."""
        check = block_table.device.type == "cpu"
        num_reqs = len(inputs.req_ids)
        computed = np.asarray(inputs.computed, dtype=np.int64)
        q_lens = np.asarray(inputs.scheduled, dtype=np.int64)
        prompt_lens = np.asarray(inputs.prompt_lens, dtype=np.int64)
        seq_lens = computed + q_lens
        compacted = self.tables.compacted(num_reqs).copy()
        ring_writes, rescores = None, []
        if self.decode is not None:
            ring_writes, rescores = self.decode.plan_step(
                inputs.req_ids,
                computed,
                q_lens,
                compacted,
                lambda slot: self.plans.plan_of(inputs, slot, int(prompt_lens[slot]))[0],
                block_table.device,
            )
        q_start = np.cumsum(q_lens) - q_lens
        echoes = self._echoes(inputs, computed, seq_lens, prompt_lens)
        whole = ~compacted & (computed == 0) & (prompt_lens <= seq_lens)
        whole[list(echoes)] = False  # an echoed prompt is compacted as a last chunk, after the forward
        prefilling = np.flatnonzero(~whole & (computed < prompt_lens))
        chunks = [
            self._chunk_rescore(inputs, int(i), compacted, computed, seq_lens, q_start, q_lens)
            for i in prefilling.tolist()
        ]
        echo_requests = []
        for c in chunks:
            if c is None or not c.evicts:
                continue
            echoed = echoes.get(c.slot) if c.final else self._between_echo(inputs, c)
            if echoed is not None:
                c.deferred = True
                echo_requests.append(EchoRequest(c, *echoed))
        compacting = [
            self._compacting(inputs, int(i), q_start, q_lens, seq_lens) for i in np.flatnonzero(whole)
        ]
        layout = None
        if compacted.any():
            layout = self.tables.layout(computed, q_lens, block_table, check)
        else:
            self.tables.skip(num_reqs)
        sizes = StepSizes(
            num_reqs,
            int(q_lens.sum()),
            max_seq_len=int(seq_lens.max(initial=0)),
            max_query_len=int(q_lens.max(initial=0)),
            seq_lens=seq_lens,
            prompt_lens=prompt_lens,
            q_lens=q_lens,
            compacted=compacted if layout is not None else None,
        )
        timer = StepTimer()
        layer_tables = LayerTables(self.tables, check)
        cap_starts = CapStarts(self.decode.records if self.decode is not None else {}, self.shape.num_layers)
        prompts = PromptEviction(
            [r for r in compacting if r is not None],
            self.shape,
            self.tables,
            block_table,
            slot_mapping,
            o_proj,
            self.chunks.rope_inv_freq,
            self.decode,
            self.records,
            timer,
            layer_tables,
            cap_starts,
        )
        echo = None
        if echo_requests:
            echo = EchoPass(echo_requests, self.chunks, block_table, o_proj, timer, layer_tables)
        work = StepWork(prompts, [c for c in chunks if c is not None], rescores, ring_writes, echo)
        tools = StepTools(self.chunks, self.decode, self.records, o_proj, timer, layer_tables, cap_starts)
        metadata = HeadBatchBuilder(sizes, self.shape, self.tables, layout, block_table)
        return EvictionStep(metadata, work, tools)

    def _echoes(
        self, inputs: StepInputs, computed: np.ndarray, seq_lens: np.ndarray, prompt_lens: np.ndarray
    ) -> dict[int, tuple[list[int], EvictionPolicy]]:
        """slot -> (echo tokens, the method's copy that reads echo queries) of the requests whose prompt
        completes in this step (no token after it) and is judged with the question echo."""
        echo = self.echo
        if echo is None or inputs.prompt_token_ids is None:
            return {}
        found = {}
        for slot in np.flatnonzero((computed < prompt_lens) & (seq_lens == prompt_lens)).tolist():
            echoed = self._echo_of(inputs, slot, int(prompt_lens[slot]), between_chunks=False)
            if echoed is not None:
                found[slot] = echoed
        return found

    def _between_echo(self, inputs: StepInputs, c: ChunkRescore) -> tuple[list[int], EvictionPolicy] | None:
        """``_echo_of`` a request evicted after an earlier chunk of its prompt in this step, when the server
        echoes between chunks (``echo_between_chunks``) and the between-chunks rule reads the method's window
        ("window", "blend"); else None."""
        echo = self.echo
        if echo is None or not echo.between_chunks or inputs.prompt_token_ids is None:
            return None
        if c.shared or c.trailing or self.chunks.between.kind not in WINDOW_KINDS:
            return None
        return self._echo_of(inputs, c.slot, c.prompt_len, between_chunks=True)

    def _echo_of(
        self, inputs: StepInputs, slot: int, prompt_len: int, between_chunks: bool
    ) -> tuple[list[int], EvictionPolicy] | None:
        """(echo tokens, the method's copy that reads that many echo queries) of a request judged with the
        question echo: after its last chunk (``QuestionEcho.tokens``) or an earlier one
        (``QuestionEcho.between_tokens``); None for a kept context, a width of 0, a method that reads no
        bounded query window, or a prompt without a user header."""
        echo = self.echo
        assert echo is not None and inputs.prompt_token_ids is not None
        _, setting = self.plans.plan_of(inputs, slot, prompt_len)
        if setting is not None and setting.keeps_context:  # a kept context is question-agnostic
            return None
        method = setting.policy if setting else self.policy
        width = echo.width if setting is None or setting.question_echo is None else setting.question_echo
        if method is None or not width or echo.policy_for(method, width) is None:
            return None
        token_of = echo.between_tokens if between_chunks else echo.tokens
        tokens = token_of(inputs.prompt_token_ids(slot), width)
        policy = echo.policy_for(method, len(tokens)) if tokens else None  # as many queries as tokens
        return None if policy is None else (tokens, policy)

    def _compacting(
        self, inputs: StepInputs, index: int, q_start: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray
    ) -> StepRequest | None:
        """A request whose whole prompt is computed in this step, when its plan evicts (else None)."""
        req_id, prompt_len = inputs.req_ids[index], int(inputs.prompt_lens[index])
        req = StepRequest(
            index, req_id, int(q_start[index]), int(q_lens[index]), int(seq_lens[index]), prompt_len
        )
        plan, setting = self.plans.plan_of(inputs, index, prompt_len)
        req.policy = setting.policy if setting else self.policy
        generated = int(seq_lens[index]) - prompt_len
        record = self.decode.admit(req_id, plan) if self.decode is not None else None
        if record is not None and plan.offset(generated) != plan.offset0:
            # Recomputed after preemption with its decode cap already applied: evict to a(t) now.
            req.plan, req.decode = plan, record
            self.tables.split()
            return req
        if not plan.compacts:
            self.records.skipped(setting.method if setting else self.policy.name)
            return None
        req.plan = plan
        req.spare = self._spare(inputs, index, plan, setting, int(seq_lens[index]))
        if not shares_tables(req.policy):
            self.tables.split()
        return req

    def _chunk_rescore(
        self,
        inputs: StepInputs,
        index: int,
        compacted: np.ndarray,
        computed: np.ndarray,
        seq_lens: np.ndarray,
        q_start: np.ndarray,
        q_lens: np.ndarray,
    ) -> ChunkRescore | None:
        """A request prefilling without its whole prompt in this step (a later chunk, or a first step that
        does not start at token 0), when its plan compacts: after a chunk that moves the offset it evicts,
        after the others only its queries are kept."""
        prompt_len = int(inputs.prompt_lens[index])
        plan, setting = self.plans.plan_of(inputs, index, prompt_len)
        n0, n1 = int(computed[index]), int(seq_lens[index])
        shared = self.plans.shared_tokens.get(inputs.req_ids[index], 0)
        completes = n1 >= prompt_len
        if not plan.compacts:
            if completes:
                self.records.skipped(setting.method if setting else self.policy.name)
            return None
        policy = setting.policy if setting else self.policy
        assert policy is not None
        if completes and not shares_tables(policy):
            self.tables.split()
        if completes and self.decode is not None:
            self.decode.admit(inputs.req_ids[index], plan)
        evicts = completes or plan.chunk_rescores(n0 - shared, n1 - shared)
        return ChunkRescore(
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
            self.chunks.reads_statistics(policy, plan.kept_length_at(n1 - shared)),
            shared,
            spare=self._spare(inputs, index, plan, setting, n1) if completes else 0,
        )

    def _spare(
        self, inputs: StepInputs, index: int, plan: RequestPlan, setting: ResolvedSetting | None, seq_len: int
    ) -> int:
        """The spare blocks the scheduler gave the request in ``index``, whose prompt completes in this step
        (``shared_prefix.spare_blocks_seen``): only a request that may get them is read (nothing generated
        before its prompt's end, no kept context, a plan that compacts once)."""
        if (
            not self.spare_columns
            or inputs.row_blocks is None
            or seq_len != int(inputs.prompt_lens[index])
            or (setting is not None and setting.keeps_context)
            or not spare_blocks(plan)
        ):
            return 0
        return spare_blocks_seen(plan, int(inputs.row_blocks[index]), seq_len, self.spare_columns)


def shares_tables(policy: EvictionPolicy | None) -> bool:
    """True when every layer of a request keeps the same count per head, so one sub-block table serves all
    its layers."""
    return keeps_equal_counts(policy)
