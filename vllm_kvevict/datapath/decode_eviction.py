"""The decode-time cap's re-score, one layer after its attention: read the keys each head holds from the
cache (the backend's cache rows), fold the ring's queries into the method's state (``observe``), ask
``select`` for at most ``a(t)`` entries per head (``RequestPlan.kept_length``, the same for every layer;
ragged with Ada-style allocation as long as the layer total fits), place the kept entries in sub-blocks of
the blocks the request keeps, and return the moves. When a request re-scores is ``decode_schedule.py``'s.
"""

from __future__ import annotations

import torch

from vllm_kvevict import metrics
from vllm_kvevict.datapath.decode_schedule import DecodeRecord, DecodeSchedule, Rescore
from vllm_kvevict.datapath.moves import CacheRows, Moves
from vllm_kvevict.datapath.placement import place, standard_entries, subblock_slots
from vllm_kvevict.datapath.records import StepTimer
from vllm_kvevict.datapath.selection import log_fallback, newest_entries
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.policies.base import KeptTokens
from vllm_kvevict.policies.decode.base import ada_caps, gather_padded


class DecodeEviction(DecodeSchedule):
    """Decode-time caps of the requests on one worker: the schedule (``DecodeSchedule``) and the re-score."""

    # ----- re-score -------------------------------------------------------------------------------------
    def rescore_layer(
        self,
        layer_idx: int,
        rescores: list[Rescore],
        block_table: torch.Tensor,
        rows: CacheRows,
        timer: StepTimer,
        check: bool,
    ) -> Moves | None:
        """Re-score ``layer_idx`` of every request in ``rescores`` and commit their new tables; returns the
        moves to make in the layer's cache (sources and destinations may overlap: gather, then scatter)."""
        if not rescores:
            return None
        moves = [self._rescore(layer_idx, r, block_table[r.slot], rows, timer, check) for r in rescores]
        if layer_idx == self.num_layers - 1:
            for r in rescores:
                self._finish(r)
        return Moves.join(moves)

    def held_entries(
        self, layer_idx: int, r: Rescore, block_row: torch.Tensor, check: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([H, L] int64 one-head-view slots, [H, L] int64 positions, -1 padded) of what each head of
        ``layer_idx`` holds now (this step's token included)."""
        bs, heads = self.block_size, self.num_kv_heads
        record = r.record
        newest = record.plan.prompt_len + r.generated - 1
        device = block_row.device
        if not r.compacted:
            return standard_entries(block_row, newest + 1, heads, bs)
        store = self.tables.store
        assert store is not None
        group = self.tables.group_of(layer_idx)
        lengths = store.lengths[group, r.slot].to(torch.int64)
        width = int(lengths.max())
        j = torch.arange(width, device=device)
        slots = subblock_slots(store.tables[group, r.slot], width, bs)
        valid = j[None, :] < lengths[:, None]
        held = record.positions[layer_idx]
        if held is None:
            raise RuntimeError(f"request {r.req_id} layer {layer_idx}: compacted without recorded positions")
        counts = (held >= 0).sum(dim=1)
        if held.shape[1]:
            from_held = held.gather(1, j.clamp(max=held.shape[1] - 1).expand(heads, width))
        else:
            from_held = torch.zeros(heads, width, dtype=torch.int64, device=device)
        tail = record.anchor + j[None, :] - counts[:, None]
        positions = torch.where(j[None, :] < counts[:, None], from_held, tail)
        if check and not torch.equal(lengths, counts + (newest + 1 - record.anchor)):
            raise RuntimeError(
                f"request {r.req_id} layer {layer_idx}: heads hold {lengths.tolist()} entries, the record "
                f"{(counts + newest + 1 - record.anchor).tolist()}"
            )
        return torch.where(valid, slots, -1), torch.where(valid, positions, -1)

    def select(
        self,
        layer_idx: int,
        record: DecodeRecord,
        keys: torch.Tensor | None,
        positions: torch.Tensor,
        queries: tuple[torch.Tensor, torch.Tensor] | None,
        cap: int,
        req_id: str = "?",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept slot indices [H, M] sorted, -1 padded; new lengths [H]) of at most ``cap`` entries per head
        on average (the layer keeps <= H x cap). keys [H, L, D] (None for a method that needs none),
        positions [H, L]; queries ([Hq, R, D], [R] positions) for ``observe``. A failing method keeps each
        head's newest ``cap`` entries instead (logged and counted): the scheduler frees the blocks anyway."""
        policy = self.policy
        heads = positions.shape[0]
        try:
            state = record.states[layer_idx]
            if state is None:
                state = policy.init_state(heads, positions.device)
            key_tensor = keys if keys is not None else torch.zeros(heads, positions.shape[1], 1)
            if queries is not None:
                state = policy.observe(state, key_tensor, positions, queries[0], queries[1])
            caps: int | torch.Tensor = cap
            if self.allocation == "ada":
                caps = ada_caps(policy, state, positions, cap)
            kept, lengths = policy.select(state, key_tensor, positions, caps)
            lengths = lengths.to(torch.int64)
            if int(lengths.sum()) <= heads * cap and bool((kept < positions.shape[1]).all()):
                if state is not None:
                    state.keep(kept)
                record.states[layer_idx] = state
                return kept, lengths
            problem = f"kept {lengths.tolist()} entries, the layer may keep {heads * cap}"
            reason = "wrong_counts"
        except (ValueError, RuntimeError) as exc:
            problem, reason = str(exc), "raised"
        log_fallback(policy.name, req_id, layer_idx, problem, cap)
        metrics.record_policy_fallback(policy.name, reason)
        record.states[layer_idx] = None
        newest = newest_entries(positions >= 0, cap)
        return newest.indices, newest.counts

    def _rescore(
        self,
        layer_idx: int,
        r: Rescore,
        block_row: torch.Tensor,
        rows: CacheRows,
        timer: StepTimer,
        check: bool,
    ) -> Moves:
        record, plan = r.record, r.record.plan
        slots, positions = self.held_entries(layer_idx, r, block_row, check)
        if self.dump:
            lengths = (positions >= 0).sum(dim=1).tolist()
            if layer_idx == 0:
                record.peaks.append((r.generated, []))
            record.peaks[-1][1].append(lengths)
        keys = None
        if self.policy.query_window:
            heads, width = slots.shape
            keys = rows.read_keys(slots.clamp(min=0)).reshape(heads, width, -1)
        queries = self._queries(layer_idx, r) if self.policy.query_window else None
        cap = plan.kept_length(r.generated)
        with timer.phase("selection"):
            kept, lengths = self.select(layer_idx, record, keys, positions, queries, cap, r.req_id)
        store = self.tables.store
        assert store is not None
        first_block = plan.blocks_freed(r.generated)
        total = int(lengths.sum())
        table = store.assign(
            lengths,
            block_row,
            first_block,
            0,
            total=total,
            num_blocks=cdiv(plan.prompt_len + r.generated, self.block_size),
            check=check,
        )
        placed = place(KeptTokens(kept, lengths), 0, 0, total, slots.device)
        self.tables.commit(layer_idx, r.slot, table, first_block)
        record.positions[layer_idx] = gather_padded(positions, kept, -1)
        return Moves(slots[placed.heads, placed.chosen], placed.destinations(table, self.block_size))

    def _queries(self, layer_idx: int, r: Rescore) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest ``policy.queries_needed(k)`` queries of the ring (prompt queries included while fewer
        tokens were generated): H2O/RoCo fold each query once and need only those since the last re-score,
        SnapKV its window. The HF reference passes the same ones."""
        record = r.record
        newest = record.plan.prompt_len + r.generated - 1
        count = min(self.ring.window, self.policy.queries_needed(record.plan.decode_interval))
        if not count:
            return self.ring.read(layer_idx, record.row)
        return self.ring.read_recent(layer_idx, record.row, newest, count)

    def _finish(self, r: Rescore) -> None:
        """Every layer of ``r`` was re-scored: its tail starts after this step's token; publish."""
        record, plan, t = r.record, r.record.plan, r.generated
        record.anchor = plan.prompt_len + t
        self.tables.mark_compacted(r.slot)
        previous = plan.offset(t - 1)
        metrics.record_decode_eviction(
            self.policy.name,
            float(plan.offset(t) - previous),
            plan.blocks_freed(t) - plan.blocks_freed(t - 1),
        )

    # ----- a prompt whose decode cap applies in its own step (recomputed after preemption) ------------
    def compact_recomputed(
        self,
        layer_idx: int,
        record: DecodeRecord,
        candidates: torch.Tensor,
        keys: torch.Tensor,
        queries: torch.Tensor,
        generated: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [H, M] (-1 padded) and counts [H] each head keeps of ``candidates`` [H, L] (positions
        of the kept prompt entries then the recomputed output, -1 padded), down to ``a(t)``.

        keys: [H, L, D] of the candidates; queries: [P + t, Hq, D] of the step (prompt and recomputed
        output; the last ``queries_needed(k)`` are observed, as at a decode-time re-score)."""
        plan = record.plan
        window = min(self.policy.query_window, self.policy.queries_needed(plan.decode_interval))
        observed = None
        if window:
            recent = queries[-window:]
            first = plan.prompt_len + generated - recent.shape[0]
            query_positions = torch.arange(first, first + recent.shape[0], device=recent.device)
            observed = (recent.transpose(0, 1), query_positions)
        record.states[layer_idx] = None
        kept, lengths = self.select(
            layer_idx, record, keys, candidates, observed, plan.kept_length(generated), "recomputed"
        )
        positions = gather_padded(candidates, kept, -1)
        record.positions[layer_idx] = positions
        if layer_idx == self.num_layers - 1:
            record.anchor = plan.prompt_len + generated
        return positions, lengths
