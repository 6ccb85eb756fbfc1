"""The decode-time cap's re-score, one layer after its attention, as a ``LayerWork`` for the executor: what
each head holds, read from the cache (the backend's cache rows: the keys and values the method reads,
dequantised on an fp8 cache, as one ``HeldLayer`` with the layer index); the method's choice of at most
``a(t)`` entries per head (``RequestPlan.kept_length``, the same for every layer; ragged with Ada-style
allocation as long as the layer total fits), after folding the ring's queries into its state (``observe``),
or its scores where the layers are ranked together; the blocks the request keeps. When a request re-scores
is ``decode_schedule.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_kvevict.datapath.decode_schedule import DecodeRecord, DecodeSchedule, Rescore
from vllm_kvevict.datapath.executor import LayerCommit, LayerWork
from vllm_kvevict.datapath.kept_selection import log_fallback
from vllm_kvevict.datapath.layer_eviction import HeldEntries, LayerTarget, held_in_store
from vllm_kvevict.datapath.moves import CacheRows, Moves
from vllm_kvevict.datapath.placement import standard_entries
from vllm_kvevict.datapath.policy_guard import PolicyFault, guarded, policy_label
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.policies.base import KeptTokens
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy, DecodeState, gather_padded
from vllm_kvevict.policies.decode.held_layer import HeldLayer


@dataclass
class DecodeChoice:
    """A decode-time method's choice over one layer's held entries (``LayerChoice``): at most ``budget``
    (the cap ``a(t)``) per head on average. held: the layer's entries (positions [H, L], -1 padded; the
    keys and values [H, L, D] the method reads); queries ([Hq, R, D], [R] positions) for ``observe``. The
    method's running state for the layer is kept when the choice holds, forgotten when the fallback keeps
    the layer."""

    policy: DecodeEvictionPolicy
    allocation: str
    record: DecodeRecord
    held: HeldLayer
    queries: tuple[torch.Tensor, torch.Tensor] | None
    budget: int
    exact: bool = False
    shared: int = 0
    _state: DecodeState | None = field(default=None, repr=False)

    def choose(self) -> KeptTokens:
        kept = guarded(self.policy, self._select, self._problem)
        if self._state is not None:
            self._state.keep(kept.indices)
        self.record.states[self.held.layer_idx] = self._state
        return kept

    def rejected(self) -> None:
        self.record.states[self.held.layer_idx] = None

    @property
    def head_unit(self) -> int:
        return 1

    def scores(self, req_id: str) -> torch.Tensor | None:
        """The method's scores [H, W] of the held entries (``+inf`` at what it always keeps, ``-inf`` at
        padding), guarded (NaN, exceptions, shape); None when it failed (logged and counted)."""
        shape = tuple(self.held.positions.shape)

        def problem(scores: torch.Tensor) -> str | None:
            found = tuple(scores.shape)
            return None if found == shape else f"scores of shape {found}, the layer holds {shape}"

        try:
            return guarded(self.policy, lambda: self.policy.scores(None, self.held).float(), problem)
        except PolicyFault as exc:
            log_fallback(policy_label(self.policy), req_id, self.held.layer_idx, str(exc), self.budget)
            return None

    def _select(self) -> KeptTokens:
        policy, held = self.policy, self.held
        state = self.record.states[held.layer_idx]
        if state is None:
            state = policy.init_state(held.num_kv_heads, held.positions.device)
        if self.queries is not None:
            state = policy.observe(state, held, self.queries[0], self.queries[1])
        caps = policy.layer_caps(state, held, self.budget, self.allocation)
        self._state = state
        kept, lengths = policy.select(state, held, caps)
        return KeptTokens(kept, lengths.to(torch.int64))

    def _problem(self, kept: KeptTokens) -> str | None:
        heads, width = self.held.positions.shape
        if int(kept.counts.sum()) <= heads * self.budget and bool((kept.indices < width).all()):
            return None
        return f"kept {kept.counts.tolist()} entries, the layer may keep {heads * self.budget}"


class DecodeEviction(DecodeSchedule):
    """Decode-time caps of the requests on one worker: the schedule (``DecodeSchedule``) and the re-score's
    description of each layer (``LayerWork``), run by the step's ``LayerCommit``."""

    # ----- re-score -------------------------------------------------------------------------------------
    def rescore_layer(
        self,
        layer_idx: int,
        rescores: list[Rescore],
        block_table: torch.Tensor,
        rows: CacheRows,
        commit: LayerCommit,
    ) -> Moves | None:
        """Re-score ``layer_idx`` of every request in ``rescores`` and commit their new tables; returns the
        moves to make in the layer's cache (sources and destinations may overlap: gather, then scatter)."""
        if not rescores:
            return None
        moves = [commit.run(self._work(layer_idx, r, block_table[r.slot], rows, commit)) for r in rescores]
        if layer_idx == self.num_layers - 1:
            for r in rescores:
                self._finish(r)
        return Moves.join([m for m in moves if m is not None])

    def held(self, layer_idx: int, r: Rescore, block_row: torch.Tensor, check: bool = True) -> HeldEntries:
        """What each head of ``layer_idx`` holds now (this step's token included)."""
        record = r.record
        newest = record.plan.prompt_len + r.generated - 1
        if not r.compacted:
            return HeldEntries(*standard_entries(block_row, newest + 1, self.num_kv_heads, self.block_size))
        held = record.positions[layer_idx]
        if held is None:
            raise RuntimeError(f"request {r.req_id} layer {layer_idx}: compacted without recorded positions")
        return held_in_store(self.tables, layer_idx, r.slot, held, record.anchor, newest + 1, r.req_id, check)

    def choice(
        self,
        record: DecodeRecord,
        held: HeldLayer,
        queries: tuple[torch.Tensor, torch.Tensor] | None,
        cap: int,
    ) -> DecodeChoice:
        """The method's choice of at most ``cap`` entries per head on average over ``held``."""
        return DecodeChoice(self.policy, self.allocation, record, held, queries, cap)

    def held_layer(
        self, layer_idx: int, positions: torch.Tensor, slots: torch.Tensor, rows: CacheRows
    ) -> HeldLayer:
        """``HeldLayer`` of ``positions`` [H, L] (-1 padded) at one-head-view cache ``slots`` [H, L]: the
        keys and values the method reads, through the backend's reader (dequantised on an fp8 cache)."""
        heads, width = slots.shape
        slots = slots.clamp(min=0)  # padding reads some row; the methods ignore (and zero) it
        keys = values = None
        if self.policy.reads_values:
            keys, values = (part.reshape(heads, width, -1) for part in rows.read(slots))
        elif self.policy.reads_keys:
            keys = rows.read_keys(slots).reshape(heads, width, -1)
        return HeldLayer(positions, keys, values, layer_idx, self.num_layers)

    def _work(
        self, layer_idx: int, r: Rescore, block_row: torch.Tensor, rows: CacheRows, commit: LayerCommit
    ) -> LayerWork:
        """One layer of ``r``'s re-score: what it holds, the method's choice down to ``a(t)``, the blocks the
        plan keeps at ``r.generated``; the record then holds the layer's new positions."""
        record, plan = r.record, r.record.plan
        held = self.held(layer_idx, r, block_row, commit.tables.check)
        self._dump_lengths(layer_idx, r, held)
        held = commit.view(held, layer_idx)
        layer = self.held_layer(layer_idx, held.positions, held.slots, rows)
        queries = self._queries(layer_idx, r) if self.policy.query_window else None
        choice = self.choice(record, layer, queries, plan.kept_length(r.generated))
        num_blocks = cdiv(plan.prompt_len + r.generated, self.block_size)
        target = LayerTarget(r.slot, r.req_id, block_row, plan.blocks_freed(r.generated), num_blocks)

        def placed(kept: KeptTokens, _: object) -> None:
            record.positions[layer_idx] = gather_padded(held.positions, kept.indices, -1)

        return LayerWork(layer_idx, held, choice, target, placed)

    def _dump_lengths(self, layer_idx: int, r: Rescore, held: HeldEntries) -> None:
        """Each head's held count before the re-score, for the debug dump (when it is on)."""
        if self.dump:
            lengths = (held.positions >= 0).sum(dim=1).tolist()
            if layer_idx == 0:
                r.record.peaks.append((r.generated, []))
            r.record.peaks[-1][1].append(lengths)

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
        """Every layer of ``r`` was re-scored: its tail starts after this step's token."""
        r.record.anchor = r.record.plan.prompt_len + r.generated
        self.tables.mark_compacted(r.slot)

    # ----- a prompt whose decode cap applies in its own step (recomputed after preemption) ------------
    def recomputed_choice(
        self,
        layer_idx: int,
        record: DecodeRecord,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        queries: torch.Tensor,
        generated: int,
    ) -> DecodeChoice:
        """The cap's choice over ``positions`` [H, L] (the kept prompt entries then the recomputed output,
        -1 padded; keys and values [H, L, D] theirs, from the step's tensors), down to ``a(t)``. queries:
        [P + t, Hq, D] of the step (prompt and recomputed output; the last ``queries_needed(k)`` are
        observed, as at a decode-time re-score)."""
        plan = record.plan
        window = min(self.policy.query_window, self.policy.queries_needed(plan.decode_interval))
        observed = None
        if window:
            recent = queries[-window:]
            first = plan.prompt_len + generated - recent.shape[0]
            query_positions = torch.arange(first, first + recent.shape[0], device=recent.device)
            observed = (recent.transpose(0, 1), query_positions)
        record.states[layer_idx] = None
        held = HeldLayer(positions, keys, values, layer_idx, self.num_layers)
        return self.choice(record, held, observed, plan.kept_length(generated))
