"""Planning one engine step: from what the model runner knows (request ids, prompt lengths, token counts)
to which requests compact their whole prompt, which are re-scored after a chunk, which start a decode cap,
and whether the batch runs head-as-sequence. The planner reads a view of the worker and changes nothing in
it: what the step needs of the worker's state (caps admitted, tables split, requests recorded as skipped)
is in its decisions, and the worker applies it (``EvictionWorker._prepare``). Python work is O(1) in the
batch for decoding requests; requests whose prompt completes or arrives in chunks are handled one by one
(they are prefills).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.chunk_eviction import ChunkEviction, ChunkRescore
from vllm_kvevict.datapath.question_echo import EchoRequest, QuestionEcho
from vllm_kvevict.datapath.request_plans import RequestPlans
from vllm_kvevict.datapath.step_inputs import StepInputs, StepRequest
from vllm_kvevict.layout.accounting import RequestPlan
from vllm_kvevict.layout.shared_prefix import spare_blocks, spare_blocks_seen
from vllm_kvevict.policies.base import EvictionPolicy, keeps_equal_counts
from vllm_kvevict.policies.between_chunks import WINDOW_KINDS

if TYPE_CHECKING:
    from vllm_kvevict.settings.request_settings import ResolvedSetting


@dataclass(frozen=True)
class PlannerView:
    """What the planner reads of the worker. ``chunks`` and ``plans`` are the worker's own, asked only
    questions that change nothing (the rule between chunks, a request's plan); ``compacted`` is a copy."""

    shape: CacheShape
    policy: EvictionPolicy
    plans: RequestPlans
    chunks: ChunkEviction
    compacted: np.ndarray  # [R] bool: the slot's request reads sub-block tables
    capped: bool  # the server caps decoding (the worker has decode state)
    echo: QuestionEcho | None = None  # the question echo (None: off)
    spare_columns: int = 0  # block-table columns for spare blocks (0: never given)


@dataclass
class StepDecisions:
    """One step as planned, before any of the worker's state changed. Host arrays [R] in batch order; the
    requests compacting, re-scored after a chunk and echoed; and what the worker applies before the step's
    layers run: ``admits`` (request, plan) whose decode cap starts, ``capped_prompts`` the compacting
    requests recomputed with their cap already applied (their ``decode`` record is set then),
    ``split_tables`` (some request keeps ragged counts across layers), ``skipped`` the methods of requests
    whose plan compacts nothing."""

    computed: np.ndarray
    q_lens: np.ndarray
    prompt_lens: np.ndarray
    seq_lens: np.ndarray
    compacted: np.ndarray
    compacting: list[StepRequest] = field(default_factory=list)
    chunks: list[ChunkRescore] = field(default_factory=list)
    echo_requests: list[EchoRequest] = field(default_factory=list)
    admits: list[tuple[str, RequestPlan]] = field(default_factory=list)
    capped_prompts: list[StepRequest] = field(default_factory=list)
    split_tables: bool = False
    skipped: list[str] = field(default_factory=list)


class StepPlanner:
    """Decides one step from a read-only view of the worker (it owns no state of its own). The worker has
    set up the step's tables and restarted the requests computing from token 0 before."""

    def __init__(self, view: PlannerView) -> None:
        self.view = view
        self.shape = view.shape
        self.policy = view.policy
        self.chunks = view.chunks  # read only
        self.plans = view.plans  # each request's plan and setting (read only)
        self.echo = view.echo
        self.spare_columns = view.spare_columns

    def plan(self, inputs: StepInputs) -> StepDecisions:
        """The step's decisions (``StepDecisions``); nothing of the worker changes."""
        computed = np.asarray(inputs.computed, dtype=np.int64)
        q_lens = np.asarray(inputs.scheduled, dtype=np.int64)
        prompt_lens = np.asarray(inputs.prompt_lens, dtype=np.int64)
        seq_lens = computed + q_lens
        compacted = self.view.compacted
        decided = StepDecisions(computed, q_lens, prompt_lens, seq_lens, compacted)
        q_start = np.cumsum(q_lens) - q_lens
        echoes = self._echoes(inputs, computed, seq_lens, prompt_lens)
        whole = ~compacted & (computed == 0) & (prompt_lens <= seq_lens)
        whole[list(echoes)] = False  # an echoed prompt is compacted as a last chunk, after the forward
        prefilling = np.flatnonzero(~whole & (computed < prompt_lens))
        chunks = [self._chunk_rescore(decided, inputs, int(i), q_start) for i in prefilling.tolist()]
        decided.chunks = [c for c in chunks if c is not None]
        for c in decided.chunks:
            if not c.evicts:
                continue
            echoed = echoes.get(c.slot) if c.final else self._between_echo(inputs, c)
            if echoed is not None:
                c.deferred = True
                decided.echo_requests.append(EchoRequest(c, *echoed))
        compacting = [self._compacting(decided, inputs, int(i), q_start) for i in np.flatnonzero(whole)]
        decided.compacting = [r for r in compacting if r is not None]
        return decided

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
        (``QuestionEcho.between_tokens``); None for a kept context, a width of 0 or a method that reads no
        bounded query window."""
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
        self, decided: StepDecisions, inputs: StepInputs, index: int, q_start: np.ndarray
    ) -> StepRequest | None:
        """A request whose whole prompt is computed in this step, when its plan evicts (else None)."""
        req_id, prompt_len = inputs.req_ids[index], int(inputs.prompt_lens[index])
        seq_len = int(decided.seq_lens[index])
        req = StepRequest(index, req_id, int(q_start[index]), int(decided.q_lens[index]), seq_len, prompt_len)
        plan, setting = self.plans.plan_of(inputs, index, prompt_len)
        req.policy = setting.policy if setting else self.policy
        capped = self.view.capped and bool(plan.decode_cap)
        if capped:
            decided.admits.append((req_id, plan))
        if capped and plan.offset(seq_len - prompt_len) != plan.offset0:
            # Recomputed after preemption with its decode cap already applied: evict to a(t) now.
            req.plan = plan
            decided.capped_prompts.append(req)
            decided.split_tables = True
            return req
        if not plan.compacts:
            decided.skipped.append(setting.method if setting else self.policy.name)
            return None
        req.plan = plan
        req.spare = self._spare(inputs, index, plan, setting, seq_len)
        if not shares_tables(req.policy):
            decided.split_tables = True
        return req

    def _chunk_rescore(
        self, decided: StepDecisions, inputs: StepInputs, index: int, q_start: np.ndarray
    ) -> ChunkRescore | None:
        """A request prefilling without its whole prompt in this step (a later chunk, or a first step that
        does not start at token 0), when its plan compacts: after a chunk that moves the offset it evicts,
        after the others only its queries are kept."""
        prompt_len = int(inputs.prompt_lens[index])
        plan, setting = self.plans.plan_of(inputs, index, prompt_len)
        n0, n1 = int(decided.computed[index]), int(decided.seq_lens[index])
        shared = self.plans.shared_tokens.get(inputs.req_ids[index], 0)
        completes = n1 >= prompt_len
        if not plan.compacts:
            if completes:
                decided.skipped.append(setting.method if setting else self.policy.name)
            return None
        policy = setting.policy if setting else self.policy
        assert policy is not None
        if completes and not shares_tables(policy):
            decided.split_tables = True
        if completes and self.view.capped and plan.decode_cap:
            decided.admits.append((inputs.req_ids[index], plan))
        evicts = completes or plan.chunk_rescores(n0 - shared, n1 - shared)
        return ChunkRescore(
            index,
            inputs.req_ids[index],
            int(q_start[index]),
            int(decided.q_lens[index]),
            n0,
            n1,
            plan,
            policy,
            bool(decided.compacted[index]),
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
