"""A simulated layer cache driven step by step exactly as the CPU backend does (write, attention-time query
ring, prefill compaction, per-chunk and decode-time re-score moves), for worker tests without a server.
Every key row encodes (position, head, layer), so reading a head's sub-blocks back tells which entries it
holds."""

from __future__ import annotations

import numpy as np
import torch

from tests.unit.layout.subblock_reference import layer_table
from vllm_kvevict.datapath.moves import Moves
from vllm_kvevict.datapath.worker import EvictionWorker, StepInputs
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.layout.kernels import dispatch
from vllm_kvevict.layout.shared_prefix import private_plan, spare_blocks
from vllm_kvevict.settings.config import EvictionConfig

HEADS, GROUP, DIM, BS, LAYERS = 3, 3, 8, 16, 3
NUM_BLOCKS = 400


def part_view(cache: torch.Tensor, part: int) -> torch.Tensor:
    """[NB*H, bs, D] keys (part 0) or values (part 1) of every sub-block of a [NB, H, bs, 2D] cache."""
    return cache.view(-1, BS, 2 * DIM)[..., part * DIM : (part + 1) * DIM]


def read_rows(view: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[N, D] rows at one-head-view ``slots`` ([N] or [H, L]) of a ``part_view``."""
    slots = slots.reshape(-1)
    return view[slots // BS, slots % BS]


class SimulatedRows:
    """The datapath's cache rows on one simulated layer cache (token-major rows; K and V move together)."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.keys = part_view(cache, 0)
        self.values = part_view(cache, 1)
        self.cache = cache

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return read_rows(self.keys, slots), read_rows(self.values, slots)

    def read_keys(self, slots: torch.Tensor) -> torch.Tensor:
        return read_rows(self.keys, slots)

    def move(self, moves: Moves) -> None:
        SimulatedEngine.move(self.cache, moves.src_slots, moves.slots)


class SimulatedEngine:
    """vLLM's side of the test: block rows that grow by position, one cache tensor per layer, and the
    backend's per-layer calls. Queries/keys are random except for the (position, head, layer) marks."""

    def __init__(self, config: EvictionConfig, spare_columns: int = 0) -> None:
        self.worker = EvictionWorker(
            config.build_policy(),
            config,
            LAYERS,
            HEADS,
            BS,
            max_num_seqs=8,
            spare_columns=spare_columns,
            layer_blocks=NUM_BLOCKS if config.pools_layers else 0,
        )
        #: request -> spare blocks the simulated scheduler gave it (``spare_columns`` > 0: every request
        #: whose step completes its prompt with nothing after it gets its plan's ``spare_blocks``)
        self.spares: dict[str, int] = {}
        hidden = HEADS * GROUP * DIM  # CriticalKV reads each layer's o_proj [hidden, q_heads * D]
        self.worker.o_proj = {layer: torch.randn(hidden, hidden) for layer in range(LAYERS)}
        # One storage, layer outermost, as vLLM allocates it: ``pooled`` is every layer's cache at once
        # (block l * NUM_BLOCKS + b is block b of layer l), what a budget pooled across layers addresses.
        self.pooled = torch.zeros(LAYERS * NUM_BLOCKS, HEADS, BS, 2 * DIM)
        self.caches = list(self.pooled.view(LAYERS, NUM_BLOCKS, HEADS, BS, 2 * DIM).unbind(0))
        self.rows: dict[str, list[int]] = {}
        self.next_block = 1
        self.generator = torch.Generator().manual_seed(0)

    def tokens(self, positions: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query [T, Hq, D], key/value [T, H, D] for tokens at ``positions`` [T]."""
        count = positions.numel()
        query = torch.randn(count, HEADS * GROUP, DIM, generator=self.generator)
        key = torch.randn(count, HEADS, DIM, generator=self.generator)
        key[:, :, 0] = positions[:, None].float()
        key[:, :, 1] = torch.arange(HEADS).float()
        key[:, :, 2] = layer
        return query, key, -key

    def share_prefix(self, req_id: str, owner: str, num_blocks: int) -> None:
        """``req_id`` starts from the first ``num_blocks`` blocks of ``owner``'s row (a prefix-cache hit);
        its first step then has ``num_blocks * BS`` computed tokens."""
        self.rows[req_id] = list(self.rows[owner][:num_blocks])

    def read_context(self, req_id: str, creator: str, first: int, count: int, reader_first: int) -> None:
        """``req_id`` starts from a kept context: ``reader_first`` null blocks (block 0), then blocks
        ``[first, first + count)`` of ``creator``'s row (what the scheduler's ``kept_context_hit`` gives)."""
        self.rows[req_id] = [0] * reader_first + list(self.rows[creator][first : first + count])

    def step(self, requests: list[tuple[str, int, int, int, dict | None]]) -> None:
        """One engine step over (req_id, prompt_len, computed, scheduled, extra_args) in batch order."""
        ids = [r[0] for r in requests]
        prompt_lens = np.array([r[1] for r in requests])
        computed = np.array([r[2] for r in requests])
        q_lens = np.array([r[3] for r in requests])
        for req_id, prompt_len, done, scheduled, _ in requests:
            if done == 0:
                self.rows[req_id] = []
                self.spares.pop(req_id, None)
            if self.worker.spare_columns and done + scheduled == prompt_len and req_id not in self.spares:
                shared = self.worker.shared_tokens.get(req_id, done)
                share = self.worker.settings.server.min_freed_share
                plan = private_plan(self.worker.plan_for, prompt_len, shared, share)
                self.spares[req_id] = spare_blocks(plan)
            row = self.rows[req_id]
            while len(row) < cdiv(done + scheduled, BS) + self.spares.get(req_id, 0):
                row.append(self.next_block)
                self.next_block += 1
        width = max(len(self.rows[i]) for i in ids)
        table = torch.zeros(len(ids), width, dtype=torch.int32)
        for i, req_id in enumerate(ids):
            table[i, : len(self.rows[req_id])] = torch.tensor(self.rows[req_id])
        positions = torch.cat([torch.arange(c, c + q) for c, q in zip(computed, q_lens, strict=True)])
        block_of = torch.cat(
            [
                table[i, torch.arange(c, c + q) // BS]
                for i, (c, q) in enumerate(zip(computed, q_lens, strict=True))
            ]
        )
        slot_mapping = block_of.to(torch.int64) * BS + positions % BS
        worker = self.worker
        row_blocks = np.array([len(self.rows[i]) for i in ids])
        worker.begin_step(
            StepInputs(ids, prompt_lens, computed, q_lens, [r[4] for r in requests], row_blocks=row_blocks)
        )
        seq_lens = torch.tensor(computed + q_lens)
        step = worker.make_step(len(ids), int(q_lens.sum()), seq_lens, table, slot_mapping)
        assert step is not None
        for layer in range(LAYERS):
            cache = self.caches[layer]
            heads_cache = self.pooled if step.pools_layers else cache  # global sub-block ids when pooled
            query, key, value = self.tokens(positions, layer)
            if step.has_compacted:
                slots, target = step.head_batch(layer).slot_mapping, heads_cache
            else:  # vLLM's own write: head h of slot s at ((s // bs) * H + h) * bs + s % bs
                heads = torch.arange(HEADS)
                slots = ((slot_mapping // BS)[:, None] * HEADS + heads) * BS + (slot_mapping % BS)[:, None]
                slots, target = slots.reshape(-1), cache
            self.write(target, slots, key.reshape(-1, DIM), value.reshape(-1, DIM))
            step.after_attention(layer, query, key, value, SimulatedRows(heads_cache))
        worker.end_step()

    @staticmethod
    def write(cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        for part, rows in ((0, keys), (1, values)):
            view = part_view(cache, part)
            view[slots // BS, slots % BS] = rows

    @staticmethod
    def move(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        dispatch.compact_subblocks(cache.view(-1, BS, 2 * DIM), src, dst, backend="torch")

    def held(self, req_id: str, layer: int) -> list[list[int]]:
        """Positions each head of ``layer`` reads through its sub-block table, checked to be its own rows."""
        table = layer_table(self.worker, req_id, layer)
        cache = self.pooled if self.worker.tables.layer_blocks else self.caches[layer]
        keys = part_view(cache, 0)
        values = part_view(cache, 1)
        held = []
        for head in range(HEADS):
            slots = table.head_slots(head)
            rows = read_rows(keys, slots)
            assert rows[:, 1].eq(head).all() and rows[:, 2].eq(layer).all()
            assert torch.equal(read_rows(values, slots), -rows)
            held.append(rows[:, 0].long().tolist())
        return held

    def blocks_read(self, req_id: str, layer: int) -> set[int]:
        table = layer_table(self.worker, req_id, layer)
        return {sub // HEADS for head in table.subblocks for sub in head}
