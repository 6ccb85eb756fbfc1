"""Whole-prompt eviction: a prompt computed in one step is scored from the keys, values and queries the
layer has in hand, and its kept entries move from the standard-layout slots it was just written to into
the sub-blocks the request keeps. A recomputed request whose decode cap already applies evicts down to that
cap in the same step. Built once per step for the requests whose prompt completes in it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.moves import Moves
from vllm_kvevict.datapath.placement import place
from vllm_kvevict.datapath.records import EvictionRecords, StepTimer
from vllm_kvevict.datapath.selection import select_kept
from vllm_kvevict.datapath.step_inputs import StepRequest
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.shared_prefix import first_kept_block
from vllm_kvevict.layout.subblock_store import TableRows
from vllm_kvevict.policies.base import KeptTokens, LayerKV

if TYPE_CHECKING:
    from vllm_kvevict.datapath.decode_eviction import DecodeEviction


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
        check: bool,
    ) -> None:
        self.requests = requests
        self.shape = shape
        self.tables = tables
        self.o_proj = o_proj
        self.rope_inv_freq = rope_inv_freq
        self.decode = decode
        self.records = records
        self.timer = timer
        self.check = check
        self._block_table = block_table
        self._slot_mapping = slot_mapping
        self._pending: dict[tuple[str, int], TableRows] = {}  # (req, group) -> table not yet committed
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
                moves.append(self._compact_with_cap(req, layer_idx, query, key, value))
                continue
            plan, policy = req.plan, req.policy
            assert plan is not None and policy is not None
            budget = plan.layer_budgets[layer_idx]
            kept = self._select(req, layer_idx, query, key, value, budget)
            trailing = req.q_len - req.prompt_len
            table = self._table_for(req, layer_idx, kept.counts, budget, trailing)
            moves.append(self._moves(req, kept, table, budget, trailing))
            if self.decode is not None and req.req_id in self.decode.records:  # the cap starts from here
                self.decode.records[req.req_id].positions[layer_idx] = kept.indices.to(torch.int64)
            if self.tables.last_layer_of_group(layer_idx):
                first_block = first_kept_block(plan, 0, req.seq_len, req.spare)
                self.tables.commit(layer_idx, req.index, table, first_block)
                del self._pending[(req.req_id, self.tables.group_of(layer_idx))]
            self._finish_layer(req, layer_idx, kept)
        return Moves.join(moves)

    def _select(
        self,
        req: StepRequest,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        budget: int,
    ) -> KeptTokens:
        """The policy's kept prompt entries of ``req`` in ``layer_idx`` (its last ``window`` queries)."""
        assert req.policy is not None
        start, end = req.q_start, req.q_start + req.prompt_len
        window = req.policy.query_window(req.prompt_len)
        layer = LayerKV(
            keys=key[start:end].transpose(0, 1),
            values=value[start:end].transpose(0, 1),
            queries=query[end - window : end].transpose(0, 1),
            layer_idx=layer_idx,
            num_layers=self.shape.num_layers,
            o_proj=self.o_proj.get(layer_idx),
            rope_inv_freq=self.rope_inv_freq,
        )
        with self.timer.phase("selection"):
            return select_kept(req.policy, layer, budget, req.req_id)

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
        bs, heads = self.shape.block_size, self.shape.num_kv_heads
        prompt_len, generated, start = req.prompt_len, req.q_len - req.prompt_len, req.q_start
        if plan.compacts:
            kept = self._select(req, layer_idx, query, key, value, plan.layer_budgets[layer_idx])
        else:
            kept = KeptTokens.everything(heads, prompt_len, key.device)
        # Candidates: the kept prompt entries then the recomputed output, per head ([H, L], -1 padded).
        counts = kept.counts.to(device=key.device, dtype=torch.int64)
        width = (int(counts.max()) if kept.indices.numel() else 0) + generated
        candidates = place(kept, generated, prompt_len, int(counts.sum()) + heads * generated, key.device)
        padded = torch.full((heads, width), -1, dtype=torch.int64, device=key.device)
        padded[candidates.heads, candidates.index] = candidates.chosen
        head_ids = torch.arange(heads, device=key.device)[:, None]
        keys = key[start + padded.clamp(min=0), head_ids]  # [H, L, D]
        positions, lengths = decode.compact_recomputed(
            layer_idx, record, padded, keys, query[start : start + req.q_len], generated
        )
        first_block = plan.blocks_freed(generated)
        total = int(lengths.sum())
        assert self.tables.store is not None
        table = self.tables.store.assign(
            lengths,
            self._block_table[req.index],
            first_block,
            0,
            total=total,
            num_blocks=cdiv(req.seq_len, bs),
            check=self.check,
        )
        placed = place(KeptTokens(positions, lengths), 0, 0, total, key.device)
        rows = placed.chosen + start
        standard = self._slot_mapping[rows].to(torch.int64)
        src = ((standard // bs) * heads + placed.heads) * bs + standard % bs
        self.tables.commit(layer_idx, req.index, table, first_block)
        self._finish_layer(req, layer_idx, kept)
        return Moves(src, placed.destinations(table, bs), rows, placed.heads)

    def _table_for(
        self, req: StepRequest, layer_idx: int, counts: torch.Tensor, budget: int, trailing: int
    ) -> TableRows:
        """The request's table for the group of ``layer_idx``: assigned at the group's first layer."""
        key = (req.req_id, self.tables.group_of(layer_idx))
        table = self._pending.get(key)
        if table is None:
            store = self.tables.store
            assert req.plan is not None and store is not None
            table = store.assign(
                counts,
                self._block_table[req.index],
                first_kept_block(req.plan, 0, req.seq_len, req.spare),
                trailing,
                total=self.shape.num_kv_heads * budget,
                num_blocks=cdiv(req.seq_len, self.shape.block_size) + req.spare,
                check=self.check,
            )
            self._pending[key] = table
        elif self.check and not torch.equal(table.lengths.to(counts.dtype), counts + trailing):
            raise RuntimeError(
                f"policy {req.policy.name if req.policy else '?'} kept different per-head counts in layers "
                f"that share one sub-block table (layer {layer_idx}); it must not be treated as uniform"
            )
        return table

    def _moves(
        self, req: StepRequest, kept: KeptTokens, table: TableRows, budget: int, trailing: int
    ) -> Moves:
        """Kept entries of one request's layer: from the standard-layout slots the prompt was written to in
        this step to its sub-block slots, head-major, the trailing tokens after each head's kept ones."""
        bs, heads = self.shape.block_size, self.shape.num_kv_heads
        device = self._slot_mapping.device
        placed = place(kept, trailing, req.prompt_len, heads * (budget + trailing), device)
        outside = placed.kept & ((placed.chosen < 0) | (placed.chosen >= req.prompt_len))
        if self.check and bool(outside.any()):  # a device read: CPU only
            raise ValueError(f"request {req.req_id}: kept indices must lie in [0, {req.prompt_len})")
        rows = placed.chosen + req.q_start
        standard = self._slot_mapping[rows].to(torch.int64)  # vLLM's slot of each kept token
        src = ((standard // bs) * heads + placed.heads) * bs + standard % bs
        return Moves(src, placed.destinations(table, bs), rows, placed.heads)

