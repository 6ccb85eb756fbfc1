"""Worker side of the decode-time cap: recent queries, re-scores every k tokens, compaction to the cap.

``DecodeEviction`` is a collaborator of ``EvictionWorker`` (the one owner of eviction state on a worker) and
holds what the cap needs per capped request: a ``DecodeRecord`` (its plan, the positions each head held at
the last compaction, the method's running state per layer) and a row of the ``QueryRing`` (the last
``policy.query_window`` post-RoPE queries per layer, not attention matrices).

When it re-scores is the accounting rule's (``RequestPlan.rescores_at``), computed for the whole batch in a
few numpy operations; the scheduler frees the blocks the same rule names. A re-score of a layer reads the
keys each head holds from the cache (a backend callback), folds the ring's queries into the method's state
(``observe``), asks ``select`` for at most ``a(t)`` entries per head (``RequestPlan.kept_length``, the same
for every layer; ragged with Ada-style allocation as long as the layer total fits), assigns the kept entries
sub-blocks in the blocks the request keeps (``SubBlockStore.assign``) and returns the moves, which the
backend makes inside the cache with ``layout.kernels.dispatch.compact_subblocks``. Per step (no re-score)
the Python cost is O(1) in layers and heads: one ring write per layer for all capped decoding requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_kvevict.layout.accounting import NEVER, RequestPlan, cdiv, evicted_offset
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.subblock_store import head_token_index
from vllm_kvevict.policies.decode.base import DecodeEvictionPolicy, DecodeState, ada_caps, gather_padded
from vllm_kvevict.vllm_adapter import metrics

logger = logging.getLogger("vllm.kvevict.decode_eviction")

#: reads key rows of a layer's cache: [N] int64 one-head-view slots -> [N, D].
KeyReader = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class DecodeRecord:
    """Decode-time state of one capped request on this worker.

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
    anchor: int = 0
    states: list[DecodeState | None] = field(default_factory=list)
    peaks: list[tuple[int, list[list[int]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.positions = [None] * self.num_layers
        self.states = [None] * self.num_layers
        self.anchor = self.plan.prompt_len


class QueryRing:
    """Recent queries of capped requests by ring row: ``queries [L, rows, R, Hq, D]`` and their positions
    ``positions [rows, R]`` int64 (-1: empty); query at position p sits at ring index p % R."""

    def __init__(self, num_layers: int, window: int) -> None:
        self.num_layers = num_layers
        self.window = window
        self.queries: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self._free: list[int] = []
        self._rows = 0

    def take_row(self) -> int:
        if self._free:
            return self._free.pop()
        self._rows += 1
        return self._rows - 1

    def release(self, row: int) -> None:
        if self.positions is not None and row < self.positions.shape[0]:
            self.positions[row] = -1
        self._free.append(row)

    def ensure(self, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Room for every row taken so far (grows by doubling)."""
        have = 0 if self.positions is None else self.positions.shape[0]
        if self._rows <= have and self.queries is not None and self.queries.dtype == dtype:
            return
        rows = max(self._rows, 2 * have, 1)
        queries = torch.zeros(self.num_layers, rows, self.window, heads, dim, dtype=dtype, device=device)
        positions = torch.full((rows, self.window), -1, dtype=torch.int64, device=device)
        if self.positions is not None and self.queries is not None:
            queries[:, :have] = self.queries.to(dtype)
            positions[:have] = self.positions
        self.queries, self.positions = queries, positions

    def read(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([Hq, R, D] queries, [R] positions) of one request's ring for ``layer``."""
        assert self.queries is not None and self.positions is not None
        return self.queries[layer, row].transpose(0, 1), self.positions[row]

    def read_recent(self, layer: int, row: int, newest: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([Hq, count, D], [count]) the queries at positions newest - count + 1 .. newest (count <= R)."""
        assert self.queries is not None and self.positions is not None
        device = self.positions.device
        index = torch.arange(newest - count + 1, newest + 1, device=device) % self.window
        return self.queries[layer, row, index].transpose(0, 1), self.positions[row, index]


@dataclass(frozen=True)
class RingWrites:
    """This step's queries to keep: token rows ``tokens`` [n] of the step's query go to ring ``rows`` [n]
    at ``index`` [n] (position % R); built once per step, used by every layer."""

    tokens: torch.Tensor
    rows: torch.Tensor
    index: torch.Tensor


@dataclass(frozen=True)
class Rescore:
    """A request whose cap re-scores in this step: batch slot, its record, decode tokens in the cache
    after the step (t), and whether it reads sub-block tables (False: still the standard layout)."""

    slot: int
    req_id: str
    record: DecodeRecord
    generated: int
    compacted: bool


@dataclass(frozen=True)
class DecodeMoves:
    """Moves of one layer inside its cache: row at one-head-view slot ``src_slots`` goes to ``slots``."""

    src_slots: torch.Tensor
    slots: torch.Tensor


class DecodeEviction:
    """Decode-time caps of the requests on one worker (see the module docstring)."""

    def __init__(
        self,
        policy: DecodeEvictionPolicy,
        allocation: str,
        num_layers: int,
        num_kv_heads: int,
        block_size: int,
        tables: BatchSubBlocks,
        interval: int | None = None,
    ) -> None:
        self.policy = policy
        self.allocation = allocation
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.tables = tables
        self.records: dict[str, DecodeRecord] = {}
        # Every request re-scores every k tokens (the server's interval in whole blocks): the ring holds
        # the queries a re-score passes, queries_needed(k) (k for H2O/RoCo, the window for SnapKV).
        k = block_size * max(1, cdiv(interval or block_size, block_size))
        self.ring = QueryRing(num_layers, min(policy.query_window, policy.queries_needed(k)))
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
        if record is None or record.plan != plan:
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
            record.anchor = record.plan.prompt_len
            self._slot_ids = None

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

    # ----- re-score -------------------------------------------------------------------------------------
    def rescore_layer(
        self,
        layer_idx: int,
        rescores: list[Rescore],
        block_table: torch.Tensor,
        read_keys: KeyReader,
        check: bool,
    ) -> DecodeMoves | None:
        """Re-score ``layer_idx`` of every request in ``rescores`` and commit their new tables; returns the
        moves to make in the layer's cache (sources and destinations may overlap: gather, then scatter)."""
        if not rescores:
            return None
        moves = [self._rescore(layer_idx, r, block_table[r.slot], read_keys, check) for r in rescores]
        if layer_idx == self.num_layers - 1:
            for r in rescores:
                self._finish(r)
        return DecodeMoves(torch.cat([m.src_slots for m in moves]), torch.cat([m.slots for m in moves]))

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
            length = newest + 1
            j = torch.arange(length, device=device)
            head = torch.arange(heads, device=device)[:, None]
            block = block_row.to(torch.int64)[j // bs][None, :]
            return (block * heads + head) * bs + j % bs, j.expand(heads, length).clone()
        store = self.tables.store
        assert store is not None
        group = self.tables.group_of(layer_idx)
        lengths = store.lengths[group, r.slot].to(torch.int64)
        width = int(lengths.max())
        j = torch.arange(width, device=device)
        table = store.tables[group, r.slot].to(torch.int64)
        slots = table[:, (j // bs).clamp(max=table.shape[1] - 1)] * bs + j % bs
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
        logger.error(
            "decode policy %r failed on layer %d (%s); keeping the newest %d entries per head",
            policy.name,
            layer_idx,
            problem,
            cap,
        )
        metrics.record_policy_fallback(policy.name, reason)
        record.states[layer_idx] = None
        return newest_entries(positions, cap)

    def _rescore(
        self, layer_idx: int, r: Rescore, block_row: torch.Tensor, read_keys: KeyReader, check: bool
    ) -> DecodeMoves:
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
            keys = read_keys(slots.clamp(min=0).reshape(-1)).reshape(heads, width, -1)
        queries = self._queries(layer_idx, r) if self.policy.query_window else None
        cap = plan.kept_length(r.generated)
        kept, lengths = self.select(layer_idx, record, keys, positions, queries, cap)
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
        heads, index = head_token_index(lengths, total)
        source = slots[heads, kept[heads, index]]
        self.tables.commit(layer_idx, r.slot, table, first_block)
        record.positions[layer_idx] = gather_padded(positions, kept, -1)
        return DecodeMoves(source, table.token_slots(self.block_size, heads, index))

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
            layer_idx, record, keys, candidates, observed, plan.kept_length(generated)
        )
        positions = gather_padded(candidates, kept, -1)
        record.positions[layer_idx] = positions
        if layer_idx == self.num_layers - 1:
            record.anchor = plan.prompt_len + generated
        return positions, lengths

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
            "rescored_at": [t for t, _ in record.peaks],
            "lengths_before": [lengths for _, lengths in record.peaks],
        }


def newest_entries(positions: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept slots [H, M] ascending, -1 padded; counts [H]) of the newest ``cap`` held entries per head."""
    valid = positions >= 0
    rank = valid.flip(1).cumsum(1).flip(1)  # 1 for the newest held entry, 2 for the one before, ...
    keep = valid & (rank <= cap)
    width = max(1, min(cap, positions.shape[1]))
    slots = torch.arange(positions.shape[1], device=positions.device).expand_as(positions)
    ordered = torch.where(keep, slots, positions.shape[1]).sort(dim=1).values[:, :width]
    return torch.where(ordered == positions.shape[1], -1, ordered), keep.sum(dim=1)
