"""Whole-prompt eviction: a prompt computed in one step is scored from the keys, values and queries the
layer has in hand, and its kept entries move from the standard-layout slots it was just written to into
the sub-blocks the request keeps. A recomputed request whose decode cap already applies evicts down to that
cap in the same step. Built once per step for the requests whose prompt completes in it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.kept_selection import PrefillChoice, select_kept
from vllm_kvevict.datapath.layer_eviction import HeldEntries, LayerTables, LayerTarget, evict_layer
from vllm_kvevict.datapath.moves import Moves
from vllm_kvevict.datapath.placement import place
from vllm_kvevict.datapath.pooled_decode import PooledTarget
from vllm_kvevict.datapath.pooled_eviction import PooledPromptEviction, global_entries
from vllm_kvevict.datapath.records import EvictionRecords, StepTimer
from vllm_kvevict.datapath.step_inputs import StepRequest
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.shared_prefix import first_kept_block
from vllm_kvevict.policies.base import KeptTokens, LayerKV
from vllm_kvevict.policies.decode.decode_policy import gather_padded
from vllm_kvevict.policies.decode.held_layer import HeldLayer

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
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        o_proj: dict[int, torch.Tensor],
        rope_inv_freq: torch.Tensor | None,
        decode: DecodeEviction | None,
        records: EvictionRecords,
        timer: StepTimer,
        layer_tables: LayerTables,
        cap_starts: CapStarts,
    ) -> None:
        self.requests = requests
        self.shape = shape
        self.tables = tables
        self.o_proj = o_proj
        self.rope_inv_freq = rope_inv_freq
        self.decode = decode
        self.records = records
        self.timer = timer
        self._block_table = block_table
        self._slot_mapping = slot_mapping
        self._tables = layer_tables
        self.cap_starts = cap_starts  # what a decode cap starts from (committed after the step)
        self._kept: dict[str, list[KeptTokens]] = {}  # req -> per layer, until its last layer
        self.pooled = PooledPromptEviction(shape, tables, block_table, slot_mapping, layer_tables.check)

    def compact_layer(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> Moves | None:
        """Score, select and place this layer's kept entries of every request compacting in this step.
        query [T, Hq, D], key/value [T, H, D] (post-RoPE, this step's rows). Every tensor of the moves is on
        the cache's device; only host-known sizes are used to build them."""
        if not self.requests:
            return None
        moves: list[Moves | None] = []
        for req in self.requests:
            if req.decode is not None:
                moves.append(self._compact_with_cap(req, layer_idx, query, key, value))
                continue
            plan, policy = req.plan, req.policy
            assert plan is not None and policy is not None
            if policy.pools_layers:
                moves.append(self._compact_pooled(req, layer_idx, query, key, value))
                continue
            held = HeldEntries.of_step_rows(
                self._slot_mapping, req.q_start, req.q_len, self.shape.num_kv_heads, self.shape.block_size
            )
            choice = PrefillChoice(
                policy,
                self._layer(req, layer_idx, query, key, value),
                self._budget(req, layer_idx),
                exact=not plan.adaptive,
            )
            first_block = first_kept_block(plan, 0, req.seq_len, req.spare)
            num_blocks = cdiv(req.seq_len, self.shape.block_size) + req.spare
            target = LayerTarget(
                req.index,
                req.req_id,
                self._block_table[req.index],
                first_block,
                num_blocks,
                req.q_len - req.prompt_len,
                adaptive_prompt=plan.prompt_len if plan.adaptive else 0,
            )
            result = evict_layer(layer_idx, held, choice, target, self._tables, self.timer)
            moves.append(result.moves)
            self.cap_starts.keep(
                req.req_id, layer_idx, result.kept.indices.to(torch.int64)
            )  # a cap starts here
            self._finish_layer(req, layer_idx, result.kept)
        return Moves.join([m for m in moves if m is not None])

    def _compact_pooled(
        self, req: StepRequest, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> Moves | None:
        """A request whose blocks are pooled across layers: this layer's scores are stashed; after the last
        layer every layer is ranked, placed and moved at once (``pooled_eviction.py``)."""
        with self.timer.phase("selection"):
            layer = self._layer(req, layer_idx, query, key, value)
            self.pooled.stash(req, layer, self._budget(req, layer_idx))
        if layer_idx < self.shape.num_layers - 1:
            return None
        with self.timer.phase("selection"):
            moves, kept = self.pooled.compact(req)
        for index, layer_kept in enumerate(kept):
            self.cap_starts.keep(req.req_id, index, layer_kept.indices.to(torch.int64))  # a cap starts here
            self._finish_layer(req, index, layer_kept)
        return moves

    @staticmethod
    def _budget(req: StepRequest, layer_idx: int) -> int:
        assert req.plan is not None
        return req.plan.layer_budgets[layer_idx]

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

    def _compact_with_cap(
        self, req: StepRequest, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> Moves:
        """A recomputed request whose decode cap already applies: the prompt's own selection (or the whole
        prompt when its plan keeps it), then the decode method over those entries and the recomputed output,
        down to ``a(t)``, compacted straight from this step's standard-layout slots."""
        record, plan, decode = req.decode, req.plan, self.decode
        assert record is not None and plan is not None and decode is not None
        if self.tables.layer_blocks:
            return self._compact_pooled_with_cap(req, layer_idx, key, value)
        bs, heads = self.shape.block_size, self.shape.num_kv_heads
        prompt_len, generated, start = req.prompt_len, req.q_len - req.prompt_len, req.q_start
        if plan.compacts:
            layer = self._layer(req, layer_idx, query, key, value)
            with self.timer.phase("selection"):
                kept = select_kept(req.policy, layer, self._budget(req, layer_idx), req.req_id)
        else:
            kept = KeptTokens.everything(heads, prompt_len, key.device)
        # Candidates: the kept prompt entries then the recomputed output, per head ([H, L], -1 padded).
        counts = kept.counts.to(device=key.device, dtype=torch.int64)
        width = (int(counts.max()) if kept.indices.numel() else 0) + generated
        candidates = place(kept, generated, prompt_len, int(counts.sum()) + heads * generated, key.device)
        padded = torch.full((heads, width), -1, dtype=torch.int64, device=key.device)
        padded[candidates.heads, candidates.index] = candidates.chosen
        every = HeldEntries.of_step_rows(self._slot_mapping, start, req.q_len, heads, bs)
        head_ids = torch.arange(heads, device=key.device)[:, None]
        slots = torch.where(padded >= 0, every.slots[head_ids, padded.clamp(min=0)], -1)
        held = HeldEntries(slots, padded, start)
        rows = start + padded.clamp(min=0)
        keys, values = key[rows, head_ids], value[rows, head_ids]  # [H, L, D]
        choice = decode.recomputed_choice(
            layer_idx, record, keys, values, padded, query[start : start + req.q_len], generated
        )
        target = LayerTarget(
            req.index,
            req.req_id,
            self._block_table[req.index],
            plan.blocks_freed(generated),
            cdiv(req.seq_len, bs),
        )
        result = evict_layer(layer_idx, held, choice, target, self._tables, self.timer)
        self.cap_starts.keep(req.req_id, layer_idx, gather_padded(padded, result.kept.indices, -1))
        if layer_idx == self.shape.num_layers - 1:
            self.cap_starts.anchor(req.req_id, plan.prompt_len + generated)
        self._finish_layer(req, layer_idx, kept)
        return result.moves

    def _compact_pooled_with_cap(
        self, req: StepRequest, layer_idx: int, key: torch.Tensor, value: torch.Tensor
    ) -> Moves | None:
        """A recomputed request whose decode cap already applies, its blocks pooled across layers: every
        row it computed in this step (the prompt and the recomputed output) is judged by the decode method
        from the step's keys and values and, after the last layer, every layer's rows are ranked together
        down to ``L · H · a(t)`` (``pooled_decode.py``)."""
        plan, decode = req.plan, self.decode
        assert plan is not None and decode is not None
        heads, bs, layers = self.shape.num_kv_heads, self.shape.block_size, self.shape.num_layers
        generated = req.q_len - req.prompt_len
        standard = HeldEntries.of_step_rows(self._slot_mapping, req.q_start, req.q_len, heads, bs)
        held = global_entries(self.tables, self.shape, layer_idx, standard, compacted=False)
        rows = slice(req.q_start, req.q_start + req.q_len)
        keys, values = key[rows].transpose(0, 1), value[rows].transpose(0, 1)  # [H, P + t, D]
        layer = HeldLayer(held.positions, keys, values, layer_idx, layers)
        target = PooledTarget.at(req.index, req.req_id, self._block_table[req.index], plan, generated)
        ranked = decode.pooled.rank(layer, held.slots, target, self.timer, self._tables.check)
        if ranked is None:
            return None
        moves, positions = ranked
        for index, kept in enumerate(positions):
            self.cap_starts.keep(req.req_id, index, kept)
            self._finish_layer(req, index, KeptTokens(kept, (kept >= 0).sum(dim=1)))
        self.cap_starts.anchor(req.req_id, plan.prompt_len + generated)
        return moves
