"""When decode-time caps re-score: the records of capped requests on a worker (plan, positions held at the
last compaction, the method's running state), their rows of the query ring, and the accounting rule's
re-score points computed for the whole batch in a few numpy operations (``RequestPlan.rescores_at``; the
scheduler frees the blocks the same rule names). Per step (no re-score) the Python cost is O(1) in layers
and heads: one ring write per layer for all capped decoding requests."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.query_ring import QueryRing, RingWrites
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.request_plan import NEVER, RequestPlan, cdiv, evicted_offset
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy, DecodeState


@dataclass
class DecodeRecord:
    """Decode-time state of one capped request on this worker.

    plan: the plan its re-scores follow: ``admitted`` (the plan the request was admitted with), or for an
        adaptive plan (KVzap's threshold) the plan of the bound its prompt kept
        (``accounting.with_kept_bound``, the one the scheduler frees blocks by once the worker reported it;
        ``DecodeSchedule.start_from``).
    positions[l]: [H, M] int64 positions each head of layer l held right after its last compaction, -1
        padded (None: never compacted, the head holds every position in the standard layout).
    anchor: first position of the tail every head appended since that compaction (same for all heads).
    states[l]: the method's running state for layer l (None until the first re-score, or stateless).
    peaks: (t, [L][H] lengths right before the re-score) for the debug dump, when it is on.
    """

    plan: RequestPlan
    row: int
    num_layers: int
    positions: list[torch.Tensor | None] = field(default_factory=list)
    admitted: RequestPlan = field(init=False)
    anchor: int = 0
    states: list[DecodeState | None] = field(default_factory=list)
    peaks: list[tuple[int, list[list[int]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.admitted = self.plan
        self.positions = [None] * self.num_layers
        self.states = [None] * self.num_layers
        self.anchor = self.plan.prompt_len


class CapStarts:
    """What the prompts compacted in one step kept, per request and layer, that their decode caps start
    from (positions [H, M], -1 padded), and the tail's first position where it moved (a prompt compacted
    to its cap with its recomputed output); ``DecodeSchedule.start_from`` commits them after the step.
    Requests without a decode cap are left out."""

    def __init__(self, records: dict[str, DecodeRecord], num_layers: int) -> None:
        self._capped = records  # read only: which requests have a cap
        self.num_layers = num_layers
        self.positions: dict[str, list[torch.Tensor | None]] = {}
        self.anchors: dict[str, int] = {}

    def keep(self, req_id: str, layer_idx: int, positions: torch.Tensor) -> None:
        if req_id in self._capped:
            self.positions.setdefault(req_id, [None] * self.num_layers)[layer_idx] = positions

    def anchor(self, req_id: str, first: int) -> None:
        if req_id in self._capped:
            self.anchors[req_id] = first


@dataclass(frozen=True)
class Rescore:
    """A request whose cap re-scores in this step: batch slot, its record, decode tokens in the cache
    after the step (t), and whether it reads sub-block tables (False: still the standard layout)."""

    slot: int
    req_id: str
    record: DecodeRecord
    generated: int
    compacted: bool


class DecodeSchedule:
    """Records, query ring and re-score points of the capped requests on one worker."""

    def __init__(
        self,
        policy: DecodeEvictionPolicy,
        allocation: str,
        shape: CacheShape,
        tables: BatchSubBlocks,
        interval: int | None = None,
    ) -> None:
        self.policy = policy
        self.allocation = allocation
        self.shape = shape
        self.num_layers = shape.num_layers
        self.num_kv_heads = shape.num_kv_heads
        self.block_size = block_size = shape.block_size
        self.tables = tables
        self.records: dict[str, DecodeRecord] = {}
        # Every request re-scores every k tokens (the server's interval in whole blocks): the ring holds
        # the queries a re-score passes, queries_needed(k) (k for H2O/RoCo, the window for SnapKV).
        k = block_size * max(1, cdiv(interval or block_size, block_size))
        self.ring = QueryRing(shape.num_layers, min(policy.query_window, policy.queries_needed(k)))
        self.dump = False  # keep per-head peaks for the debug dump
        # [R] per batch slot, rebuilt when the batch changes: cap parameters of the evicted_offset rule.
        self._slot_ids: list[str] | None = None
        self._rule = np.zeros((6, 0), dtype=np.int64)  # P, O0, t1, C, k, row (row -1: uncapped)

    # ----- records --------------------------------------------------------------------------------------
    def admit(self, req_id: str, plan: RequestPlan) -> DecodeRecord | None:
        """The record of a capped request (created on first sight); None for a request without a cap."""
        if not plan.decode_cap:
            return None
        record = self.records.get(req_id)
        if record is None or record.admitted != plan:
            if record is not None:
                self.ring.release(record.row)
            record = DecodeRecord(plan, self.ring.take_row(), self.num_layers)
            self.records[req_id] = record
            self._slot_ids = None
        return record

    def restart(self, req_id: str) -> None:
        """A request computing from token 0 again (new, or recomputed after preemption)."""
        record = self.records.get(req_id)
        if record is not None:
            self.ring.release(record.row)
            record.row = self.ring.take_row()
            record.positions = [None] * self.num_layers
            record.states = [None] * self.num_layers
            record.plan = record.admitted  # a recomputed prompt reports its own bound again
            record.anchor = record.plan.prompt_len
            self._slot_ids = None

    def start_from(self, starts: CapStarts, kept_plans: Mapping[str, RequestPlan]) -> None:
        """Commit what the prompts compacted in the step that ended kept: their caps start from it. A prompt
        of an adaptive plan kept a bound of its own (``kept_plans``: the plan each compacted request now
        holds blocks by, ``EvictionRecords.requests``): its re-scores follow that plan's rule from now on,
        as the scheduler's frees do once the step's report reaches it."""
        for req_id, per_layer in starts.positions.items():
            record = self.records.get(req_id)
            if record is None:
                continue
            kept_plan = kept_plans.get(req_id)
            if kept_plan is not None and kept_plan.adaptive and kept_plan != record.plan:
                record.plan = kept_plan
                self._slot_ids = None  # the batch's rule is rebuilt from the records' plans
            for layer_idx, positions in enumerate(per_layer):
                if positions is not None:
                    record.positions[layer_idx] = positions
        for req_id, first in starts.anchors.items():
            record = self.records.get(req_id)
            if record is not None:
                record.anchor = first

    def drop(self, req_id: str) -> DecodeRecord | None:
        record = self.records.pop(req_id, None)
        if record is not None:
            self.ring.release(record.row)
            self._slot_ids = None
        return record

    # ----- per step -------------------------------------------------------------------------------------
    def plan_step(
        self,
        req_ids: list[str],
        computed: np.ndarray,
        q_lens: np.ndarray,
        compacted: np.ndarray,
        plan_of: Callable[[int], RequestPlan],
        device: torch.device,
    ) -> tuple[RingWrites | None, list[Rescore]]:
        """This step's ring writes and re-scores. ``plan_of(slot)`` gives a request's plan; it is asked only
        when the batch changed (O(R) then, numpy over the batch otherwise)."""
        if req_ids != self._slot_ids:
            rule = np.zeros((6, len(req_ids)), dtype=np.int64)
            rule[2], rule[5] = NEVER, -1
            for slot, req_id in enumerate(req_ids):
                record = self.admit(req_id, plan_of(slot))
                if record is not None:
                    plan = record.plan
                    rule[:, slot] = (
                        plan.prompt_len,
                        plan.offset0,
                        plan.first_rescore,
                        plan.decode_cap,
                        plan.decode_interval,
                        record.row,
                    )
            self._rule, self._slot_ids = rule, list(req_ids)
        prompt, offset0, first, cap, interval, rows = self._rule
        if not (rows >= 0).any():
            return None, []
        positions = computed.astype(np.int64)  # the position of a decode step's one token
        decoding = (rows >= 0) & (q_lens == 1) & (positions >= prompt)
        # A prompt completing in this step leaves its last R queries too: a re-score soon after it (a
        # prefill budget above the cap) sees the same recent queries as the HF reference does.
        prefilling = (rows >= 0) & (positions < prompt) & (positions + q_lens >= prompt)
        writes = None
        self._ring_positions = None
        if self.ring.window and (decoding.any() or prefilling.any()):
            slots = np.flatnonzero(decoding | prefilling)
            count = np.minimum(q_lens[slots], self.ring.window)
            slot_of = np.repeat(slots, count)
            back = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)  # 0.. per slot
            from_end = np.repeat(count, count) - back  # count .. 1
            tokens = np.cumsum(q_lens)[slot_of] - from_end
            token_positions = positions[slot_of] + q_lens[slot_of] - from_end
            ring_rows = rows[slot_of]
            index = token_positions % self.ring.window
            packed = torch.from_numpy(np.stack([tokens, ring_rows, index, token_positions])).to(device)
            writes = RingWrites(packed[0], packed[1], packed[2])
            self._ring_positions = (packed[1], packed[2], packed[3])
        generated = positions + q_lens - prompt
        bs = self.block_size
        now = evicted_offset(prompt, offset0, first, cap, interval, bs, generated)
        before = evicted_offset(prompt, offset0, first, cap, interval, bs, generated - 1)
        rescoring = np.flatnonzero(decoding & (now != before))
        rescores = [
            Rescore(
                int(slot),
                req_ids[slot],
                self.records[req_ids[slot]],
                int(generated[slot]),
                bool(compacted[slot]),
            )
            for slot in rescoring
        ]
        return writes, rescores

    def record_queries(self, layer_idx: int, query: torch.Tensor, writes: RingWrites) -> None:
        """Keep this step's queries of capped decoding requests for ``layer_idx``; query [T, Hq, D]."""
        ring = self.ring
        ring.ensure(query.shape[1], query.shape[2], query.dtype, query.device)
        assert ring.queries is not None and ring.positions is not None
        if layer_idx == 0 and self._ring_positions is not None:
            rows, index, positions = self._ring_positions
            ring.positions[rows, index] = positions
        ring.queries[layer_idx, writes.rows, writes.index] = query[writes.tokens]

    def dump_record(self, req_id: str) -> dict | None:
        """The debug-dump entry of a finished capped request (None when it never re-scored)."""
        record = self.records.get(req_id)
        if record is None or not record.peaks:
            return None
        return {
            "req_id": req_id,
            "prompt_len": record.plan.prompt_len,
            "decode_cap": record.plan.decode_cap,
            "decode_interval": record.plan.decode_interval,
            "block_size": record.plan.block_size,
            "kept_bound": record.plan.kept_bound,  # an adaptive plan's: the bound its prompt reported
            "rescored_at": [t for t, _ in record.peaks],
            "lengths_before": [lengths for _, lengths in record.peaks],
        }
