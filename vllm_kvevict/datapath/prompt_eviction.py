"""Whole-prompt eviction: a prompt computed in one step is scored from the keys, values and queries the
layer has in hand, and its kept entries move from the standard-layout slots it was just written to into
the sub-blocks the request keeps. A recomputed request whose decode cap already applies evicts down to that
cap in the same step. Built once per step for the requests whose prompt completes in it; each layer of each
request is described as a ``LayerWork`` and run by the step's ``LayerCommit``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.executor import LayerCommit, LayerWork
from vllm_kvevict.datapath.kept_selection import PrefillChoice, select_kept
from vllm_kvevict.datapath.layer_eviction import HeldEntries, LayerTarget
from vllm_kvevict.datapath.moves import Moves
from vllm_kvevict.datapath.placement import Placement, place
from vllm_kvevict.datapath.pooled_eviction import pooled_plan
from vllm_kvevict.datapath.records import EvictionRecords
from vllm_kvevict.datapath.step_inputs import StepRequest
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.shared_prefix import first_kept_block
from vllm_kvevict.policies.base import KeptTokens, LayerKV
from vllm_kvevict.policies.decode.decode_policy import gather_padded

if TYPE_CHECKING:
    from vllm_kvevict.datapath.decode_rescore import DecodeEviction
    from vllm_kvevict.datapath.decode_schedule import CapStarts


class PromptEviction:
    """The step's whole-prompt compactions, layer by layer (tables shared by a group of layers are assigned
    at the group's first layer and committed after its last)."""

    def __init__(
        self,
        requests: list[StepRequest],
        shape: CacheShape,
        tables: BatchSubBlocks,
        steps: tuple[torch.Tensor, torch.Tensor],
        o_proj: dict[int, torch.Tensor],
        rope_inv_freq: torch.Tensor | None,
        decode: DecodeEviction | None,
        records: EvictionRecords,
        commit: LayerCommit,
        cap_starts: CapStarts,
    ) -> None:
        self.requests = requests
        self.shape = shape
        self.tables = tables
        self._block_table, self._slot_mapping = steps  # vLLM's block table [R', W], slot mapping [T']
        self.o_proj = o_proj
        self.rope_inv_freq = rope_inv_freq
        self.decode = decode
        self.records = records
        self.commit = commit
        self.cap_starts = cap_starts  # what a decode cap starts from (committed after the step)
        self._kept: dict[str, list[KeptTokens]] = {}  # req -> per layer, until its last layer

    def compact_layer(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> Moves | None:
        """Score, select and place this layer's kept entries of every request compacting in this step.
        query [T, Hq, D], key/value [T, H, D] (post-RoPE, this step's rows). Every tensor of the moves is on
        the cache's device; only host-known sizes are used to build them."""
        if not self.requests:
            return None
        moves = []
        for req in self.requests:
            if req.decode is not None:
                work = self._capped_work(req, layer_idx, query, key, value)
            else:
                work = self._prompt_work(req, layer_idx, query, key, value)
            moved = self.commit.run(work)
            if moved is not None:
                moves.append(moved)
        return Moves.join(moves)

    def _held(self, req: StepRequest, layer_idx: int) -> HeldEntries:
        """Every row ``req`` computed in this step, as its heads hold them in the layer's cache."""
        heads, bs = self.shape.num_kv_heads, self.shape.block_size
        held = HeldEntries.of_step_rows(self._slot_mapping, req.q_start, req.q_len, heads, bs)
        return self.commit.view(held, layer_idx)

    def _prompt_work(
        self, req: StepRequest, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> LayerWork:
        """The prompt of ``req`` in ``layer_idx``: its policy's choice down to the layer budget, the tokens
        computed after the prompt (a recomputed request) kept whole after it."""
        plan, policy = req.plan, req.policy
        assert plan is not None and policy is not None
        layer = self._layer(req, layer_idx, query, key, value)
        choice = PrefillChoice(policy, layer, plan.layer_budgets[layer_idx], exact=not plan.adaptive)
        heads = self.shape.num_kv_heads

        def pooled_first(kept: list[KeptTokens]) -> int:
            return first_kept_block(pooled_plan(plan, kept, heads), 0, req.seq_len, req.spare)

        target = LayerTarget(
            req.index,
            req.req_id,
            self._block_table[req.index],
            first_kept_block(plan, 0, req.seq_len, req.spare),
            cdiv(req.seq_len, self.shape.block_size) + req.spare,
            req.q_len - req.prompt_len,
            adaptive_prompt=plan.prompt_len if plan.adaptive else 0,
            pooled_first=pooled_first if plan.adaptive else None,
        )

        def placed(kept: KeptTokens, _: Placement) -> None:
            self.cap_starts.keep(req.req_id, layer_idx, kept.indices.to(torch.int64))  # a cap starts here
            self._finish_layer(req, layer_idx, kept)

        return LayerWork(layer_idx, self._held(req, layer_idx), choice, target, placed)

    def _layer(
        self, req: StepRequest, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> LayerKV:
        """The prompt of ``req`` in ``layer_idx`` as its policy reads it (its last ``window`` queries)."""
        assert req.policy is not None
        start, end = req.q_start, req.q_start + req.prompt_len
        window = req.policy.query_window(req.prompt_len)
        return LayerKV(
            keys=key[start:end].transpose(0, 1),
            values=value[start:end].transpose(0, 1),
            queries=query[end - window : end].transpose(0, 1),
            layer_idx=layer_idx,
            num_layers=self.shape.num_layers,
            o_proj=self.o_proj.get(layer_idx),
            rope_inv_freq=self.rope_inv_freq,
        )

    def _finish_layer(self, req: StepRequest, layer_idx: int, kept: KeptTokens) -> None:
        """A compacted layer of ``req``; after its last layer the request is compacted and published."""
        self._kept.setdefault(req.req_id, []).append(kept)
        if layer_idx == self.shape.num_layers - 1:
            per_layer = self._kept.pop(req.req_id)
            self.records.dump_prompt(req, per_layer)
            kept_per_head = torch.stack([k.counts for k in per_layer]).tolist()  # once per request
            self.tables.mark_compacted(req.index, req.spare)
            self.records.compacted(req, kept_per_head)

    def _capped_work(
        self, req: StepRequest, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> LayerWork:
        """A recomputed request whose decode cap already applies: the decode method's choice down to
        ``a(t)`` over the prompt's own selection (or the whole prompt when its plan keeps it) then the
        recomputed output, compacted straight from this step's standard-layout slots. Ranked across layers,
        every row it computed is judged, with no selection of the prompt first."""
        record, plan, decode = req.decode, req.plan, self.decode
        assert record is not None and plan is not None and decode is not None
        heads, device = self.shape.num_kv_heads, key.device
        prompt_len, generated, start = req.prompt_len, req.q_len - req.prompt_len, req.q_start
        every = self._held(req, layer_idx)
        prompt_kept = None  # the prompt's own selection (None: every row is a candidate)
        if not self.commit.across_layers:
            prompt_kept = KeptTokens.everything(heads, prompt_len, device)
            if plan.compacts:
                layer = self._layer(req, layer_idx, query, key, value)
                with self.commit.timer.phase("selection"):
                    budget = plan.layer_budgets[layer_idx]
                    prompt_kept = select_kept(req.policy, layer, budget, req.req_id)
        held = every
        head_ids = torch.arange(heads, device=device)[:, None]
        if prompt_kept is not None:  # candidates: the kept prompt entries then the recomputed output [H, L]
            counts = prompt_kept.counts.to(device=device, dtype=torch.int64)
            width = (int(counts.max()) if prompt_kept.indices.numel() else 0) + generated
            total = int(counts.sum()) + heads * generated
            candidates = place(prompt_kept, generated, prompt_len, total, device)
            padded = torch.full((heads, width), -1, dtype=torch.int64, device=device)
            padded[candidates.heads, candidates.index] = candidates.chosen
            slots = torch.where(padded >= 0, every.slots[head_ids, padded.clamp(min=0)], -1)
            held = HeldEntries(slots, padded, start)
        rows = start + held.positions.clamp(min=0)
        keys, values = key[rows, head_ids], value[rows, head_ids]  # [H, L, D]
        choice = decode.recomputed_choice(
            layer_idx, record, keys, values, held.positions, query[start : start + req.q_len], generated
        )
        num_blocks = cdiv(req.seq_len, self.shape.block_size)
        block_row = self._block_table[req.index]
        target = LayerTarget(req.index, req.req_id, block_row, plan.blocks_freed(generated), num_blocks)

        def placed(kept: KeptTokens, _: Placement) -> None:
            positions = gather_padded(held.positions, kept.indices, -1)
            self.cap_starts.keep(req.req_id, layer_idx, positions)
            if layer_idx == self.shape.num_layers - 1:
                self.cap_starts.anchor(req.req_id, plan.prompt_len + generated)
            recorded = prompt_kept if prompt_kept is not None else KeptTokens(positions, kept.counts)
            self._finish_layer(req, layer_idx, recorded)

        return LayerWork(layer_idx, held, choice, target, placed)
