"""What the worker publishes about eviction: the plans of compacted requests, their resident entries per
KV head (metrics), the step time by phase, and the optional debug dump of kept indices
(``KVEVICT_DEBUG_DUMP_DIR``). A collaborator of ``EvictionWorker``; the datapath's modes report to it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from vllm_kvevict import metrics
from vllm_kvevict.datapath.step_inputs import StepRequest
from vllm_kvevict.layout.accounting import RequestPlan, adaptive_kept_bound, with_kept_bound
from vllm_kvevict.policies.base import KeptTokens

#: When set, the worker saves each compacted request's kept indices per layer/head there (off by default).
DEBUG_DUMP_ENV = "KVEVICT_DEBUG_DUMP_DIR"


class EvictionRecords:
    """Per-request records of one worker: plans of compacted requests, kept entries for the metrics, and
    (debug dump only) what each layer kept."""

    def __init__(self, num_kv_heads: int) -> None:
        self.num_kv_heads = num_kv_heads
        self.requests: dict[str, RequestPlan] = {}  # compacted requests
        self.kept_tokens: dict[str, float] = {}  # req -> mean kept prompt entries per KV head (metrics)
        self.kept_by_slot = np.zeros(0)  # [R] kept_tokens of each batch slot (nan: not compacted)
        #: req -> its compacted prompt's kept entries [layer][kv head] (a kept context's entry counts)
        self.prompt_counts: dict[str, list[list[int]]] = {}
        self._slot_ids: list[str] | None = None
        self.chunk_history: dict[str, list] = {}  # req -> held sets after each chunk (debug dump only)
        #: req -> kept bound B'_r of an adaptive plan compacted in this process, until the runner's output of
        #: the step carries it to the scheduler (``take_kept_bounds``)
        self.kept_bounds: dict[str, int] = {}
        dump = os.environ.get(DEBUG_DUMP_ENV)
        self.dump_dir = Path(dump) if dump else None

    # ----- batch membership -----------------------------------------------------------------------------
    def align(self, req_ids: list[str]) -> None:
        """Index the kept entries by this step's batch slots (rebuilt only when the batch changed)."""
        if req_ids != self._slot_ids:
            self.kept_by_slot = np.array([self.kept_tokens.get(r, np.nan) for r in req_ids])
            self._slot_ids = list(req_ids)

    def restart(self, slot: int, req_id: str) -> None:
        """A request computing from token 0 again (new, or recomputed after preemption)."""
        self.requests.pop(req_id, None)
        self.prompt_counts.pop(req_id, None)
        self.kept_tokens.pop(req_id, None)
        self.chunk_history.pop(req_id, None)
        self.kept_bounds.pop(req_id, None)
        self.kept_by_slot[slot] = np.nan

    def drop(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.prompt_counts.pop(req_id, None)
        self.kept_tokens.pop(req_id, None)
        self.chunk_history.pop(req_id, None)
        self.kept_bounds.pop(req_id, None)
        self._slot_ids = None

    def _set_kept(self, req_id: str, slot: int, kept: float) -> None:
        self.kept_tokens[req_id] = kept
        self.kept_by_slot[slot] = kept

    # ----- what the modes report ------------------------------------------------------------------------
    def compacted(self, req: StepRequest, kept_per_head: list[list[int]]) -> None:
        """A prompt was compacted in its own step: kept counts [layer][kv head], blocks freed."""
        assert req.plan is not None and req.policy is not None
        kept = sum(map(sum, kept_per_head)) / (len(kept_per_head) * self.num_kv_heads)
        if req.decode is not None:  # compacted straight to its decode cap: a(t) resident
            generated = req.seq_len - req.prompt_len
            kept = float(req.plan.kept_length(generated) - generated)
        self._set_kept(req.req_id, req.index, kept)
        plan = self._kept_plan(req.req_id, req.plan, kept_per_head, req.decode is None)
        self.prompt_counts[req.req_id] = kept_per_head
        metrics.record_kept_per_head(req.policy.name, req.prompt_len, kept_per_head, plan.blocks_to_free)

    def _kept_plan(
        self, req_id: str, plan: RequestPlan, kept_per_head: list[list[int]], reports: bool = True
    ) -> RequestPlan:
        """The plan a compacted request holds blocks by: an adaptive plan takes the bound of its largest
        layer (noted for the scheduler, ``take_kept_bounds``), any other is itself. ``reports`` False (a
        recomputed prompt evicted straight to its decode cap, which keeps the a(t) of the plan it was
        admitted with): no bound, both sides go on by ``plan``."""
        if plan.adaptive and reports:
            bound = adaptive_kept_bound(plan, [sum(layer) for layer in kept_per_head], self.num_kv_heads)
            plan = with_kept_bound(plan, bound)
            self.kept_bounds[req_id] = bound
        self.requests[req_id] = plan
        return plan

    def take_kept_bounds(self) -> dict[str, int]:
        """Kept bounds of adaptive plans compacted since the last call (the step's report to the
        scheduler)."""
        bounds, self.kept_bounds = self.kept_bounds, {}
        return bounds

    def chunk_evicted(
        self,
        req: StepRequest,
        plan: RequestPlan,
        final: bool,
        kept: list[KeptTokens] | None,
        trailing: int,
        method: str,
    ) -> None:
        """Every layer of a prompt evicted between chunks was re-scored after this step's chunk."""
        if not final:
            if kept is not None:  # debug dump: what each head holds after this chunk
                history = self.chunk_history.setdefault(req.req_id, [])
                history.append((req.seq_len, [(k.indices.cpu(), k.counts.cpu()) for k in kept]))
            held = plan.kept_length_at(req.seq_len)
            # resident = kept + (seq_len - prompt_len) in publish_step: the held entries here.
            self._set_kept(req.req_id, req.index, float(held + plan.prompt_len - req.seq_len))
            return
        assert kept is not None
        prompt_counts = [(k.counts - trailing).tolist() for k in kept]
        self._set_kept(
            req.req_id, req.index, sum(map(sum, prompt_counts)) / (len(prompt_counts) * self.num_kv_heads)
        )
        plan = self._kept_plan(req.req_id, plan, prompt_counts)
        self.prompt_counts[req.req_id] = prompt_counts
        metrics.record_kept_per_head(method, plan.prompt_len, prompt_counts, plan.blocks_to_free)
        if self.dump_dir is not None:
            self.dump_prompt(req, [KeptTokens(k.indices.cpu(), k.counts.cpu()) for k in kept])

    def skipped(self, method: str) -> None:
        """A request whose plan compacts nothing (its prompt fits, or too little would be freed)."""
        metrics.record_request_skipped(method)

    def rescored(self, req_id: str, slot: int, plan: RequestPlan, generated: int, method: str) -> None:
        """Every layer of a capped request was re-scored by decode method ``method``: its resident entries
        per head are now a(t); the rule evicted ``O(t) - O(t - 1)`` entries per head and freed blocks."""
        metrics.record_decode_eviction(
            method,
            float(plan.offset(generated) - plan.offset(generated - 1)),
            plan.blocks_freed(generated) - plan.blocks_freed(generated - 1),
        )
        self.requests[req_id] = plan
        # resident = kept + generated (see publish_step): a(t) after the re-score.
        self._set_kept(req_id, slot, float(plan.kept_length(generated) - generated))

    def publish_step(
        self, num_reqs: int, seq_lens: np.ndarray, prompt_lens: np.ndarray, seconds: dict[str, float]
    ) -> None:
        """The step's eviction time by phase and the batch's resident entries per KV head."""
        if seconds.get("total", 0.0) > 0:
            for phase, value in seconds.items():
                metrics.observe_eviction_step(value, phase)
        resident = np.nansum(self.kept_by_slot[:num_reqs] + seq_lens - prompt_lens)
        metrics.set_kv_tokens_resident(float(resident))

    # ----- debug dump -----------------------------------------------------------------------------------
    def dump_prompt(self, req: StepRequest, kept: list[KeptTokens] | None) -> None:
        """Save what every layer of a compacted prompt kept, and (evicted between chunks) what each head held
        after each chunk: (computed tokens, per layer (positions [H, M] -1 padded, counts [H]))."""
        history = self.chunk_history.pop(req.req_id, [])
        if self.dump_dir is None or kept is None:
            return
        record = {
            "req_id": req.req_id,
            "prompt_len": req.prompt_len,
            "indices": [k.indices.cpu() for k in kept],
            "counts": [k.counts.cpu() for k in kept],
            "chunks": history,
        }
        self._save(req.req_id, ".pt", record)

    def dump_decode(self, req_id: str, record: dict | None) -> None:
        """Save a finished capped request's per-head lengths before each re-score."""
        if self.dump_dir is not None and record is not None:
            self._save(req_id, ".decode.pt", record)

    def _save(self, req_id: str, suffix: str, record: dict) -> None:
        assert self.dump_dir is not None
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in req_id)
        path = self.dump_dir / f"{safe}{suffix}"
        partial = path.with_name(path.name + ".partial")  # a reader globbing for the suffix never sees half
        torch.save(record, partial)
        partial.replace(path)
