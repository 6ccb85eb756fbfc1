"""A prompt computed in several steps with a request's blocks pooled across layers (``budget_scope:
"model"``): evicted between chunks (``prefill: chunked``) or once after its last chunk (``prefill: whole``).

After the step that brings a request from n0 to n1 computed tokens, each layer reads what it holds (the
entries it kept at its last eviction, in any layer's region of the request's blocks, then the chunk) and
scores every entry by its own cache row (the policy's ``entry_scores``), forcing by position what the method
always keeps (``forced_by_position``; KVzap: the prompt's first ``sinks`` tokens, the newest ``window``
arrived ones — the prompt's real last window at its last chunk — and those after the prompt, a recomputed
request). No entry moves before the last layer has run (a move into another layer's region would overwrite
rows that layer still reads), so each layer stashes its held slots, positions and scores; after the last layer
the entries of every layer and head are ranked together — ``L · H · a(n1)`` kept between chunks, the per-layer
rule's total, so the scheduler's offset is unchanged, and ``H · Σ_l B_l`` after the last chunk — every layer's
table is assigned from the request's one pool from the rule's first kept block, and one ``Moves`` over the
whole allocation makes them. A kept context's creator (``KVzap.head_unit`` > 1) keeps every (layer, head)
count in whole sub-blocks, its tokens after the context in pool entries after every layer's context
(``place_across_layers``).

A token's score is its own row's, so after the last chunk a request holds what whole-prompt eviction keeps of
the same rows whenever ``a(n) ≥ B'`` (every entry the final ranking keeps outranks all but ``L·H·B'`` others
at every earlier eviction): tested through the worker's datapath (``tests/unit/datapath/
test_pooled_worker.py``). Above layer 0 a model's later chunks attend to the kept entries only, so their rows
differ from a whole prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.chunk_rescore import ChunkRescore
from vllm_kvevict.datapath.layer_eviction import HeldEntries
from vllm_kvevict.datapath.moves import Moves
from vllm_kvevict.datapath.pooled_eviction import (
    kept_across_held,
    place_across_layers,
    pooled_plan,
    scores_or_fallback,
)
from vllm_kvevict.datapath.shared_reads import HeldReads
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.shared_prefix import first_kept_block
from vllm_kvevict.policies.base import KeptTokens, LayerKV, ScoredPolicy


@dataclass(frozen=True)
class StashedLayer:
    """One layer of one request until the last layer has run: what its heads hold, as slots [H, W] of the
    whole allocation and positions [H, W] (-1 padded), of which the first ``ranked`` columns are judged,
    with their scores [H, ranked] float32 (``+inf``: always kept; None: the scorer failed, the request keeps
    each layer's newest entries); the columns after them are tokens after the prompt, kept whole. The
    first ``shared`` columns are a prefix shared through vLLM's prefix cache: held as they are, never
    judged or moved."""

    slots: torch.Tensor
    positions: torch.Tensor
    ranked: int
    scores: torch.Tensor | None
    shared: int = 0

    @property
    def judged(self) -> torch.Tensor:
        """[H, ranked] bool: the held entries the ranking judges (False: padding, a shared prefix)."""
        return self.positions[:, : self.ranked] >= self.shared


class PooledChunks:
    """The stashed layers of the step's pooled re-scores, by request, and their ranking after the last
    layer."""

    def __init__(self, shape: CacheShape, tables: BatchSubBlocks) -> None:
        self.shape = shape
        self.tables = tables
        self._stashed: dict[str, list[StashedLayer]] = {}

    def stash(self, layer_idx: int, r: ChunkRescore, held: HeldEntries, reads: HeldReads) -> None:
        """Read and score what ``layer_idx`` of ``r`` holds (``held``: slots of the whole allocation) and
        keep it until the last layer; a failing scorer is logged and counted."""
        policy = r.policy
        assert isinstance(policy, ScoredPolicy) and policy.pools_layers, "only a pooling scorer is ranked so"
        ranked, shared = held.width - self.trailing(r), r.shared
        positions = held.positions[:, shared:ranked]  # a shared prefix is neither read nor judged
        keys, values = reads.read(held.slots[:, shared:ranked].clamp(min=0), 0, True)  # padding: masked below
        assert values is not None
        layer = LayerKV(
            keys=keys,
            values=values.to(keys.dtype),
            queries=keys[:, :0],
            layer_idx=layer_idx,
            num_layers=self.shape.num_layers,
        )
        scores = scores_or_fallback(policy, layer, self.budget(r, layer_idx), r.req_id, own_rows=True)
        if scores is not None:
            window_end = r.prompt_len if r.final else r.seq_len
            forced = policy.forced_by_position(positions, window_end)
            scores = torch.where(forced & (positions >= 0), float("inf"), scores)
            scores = torch.nn.functional.pad(scores, (shared, 0), value=float("-inf"))  # [H, ranked]
        stashed = StashedLayer(held.slots, held.positions, ranked, scores, shared)
        self._stashed.setdefault(r.req_id, []).append(stashed)

    @staticmethod
    def trailing(r: ChunkRescore) -> int:
        """Tokens after the prompt (a recomputed request, a kept context's creator) kept whole after the
        ranked entries: the last columns of every head while the request holds vLLM's layout. A compacted
        request's heads hold ragged counts: its tokens after the prompt are ranked, forced kept."""
        return 0 if r.compacted else r.trailing

    def budget(self, r: ChunkRescore, layer_idx: int) -> int:
        """Entries per head ``layer_idx`` of ``r`` ranks into its kept set on average: its layer budget after
        the last chunk, ``a(n1)`` before, plus the tokens after the prompt it ranks (forced kept)."""
        plan = r.plan
        budget = plan.layer_budgets[layer_idx] if r.final else plan.kept_length_at(r.seq_len - r.shared)
        return budget + r.trailing - self.trailing(r)

    def compact(
        self, r: ChunkRescore, block_row: torch.Tensor, check: bool
    ) -> tuple[Moves, list[KeptTokens]]:
        """After the last layer: rank the stashed layers of ``r`` together, assign every layer's table and
        return the moves with what each layer holds now (positions [H, M] -1 padded, counts [H])."""
        stashed = self._stashed.pop(r.req_id)
        if len(stashed) != self.shape.num_layers:
            layers = self.shape.num_layers
            raise RuntimeError(f"request {r.req_id}: {len(stashed)} of {layers} layers were scored")
        budgets = [self.budget(r, layer_idx) for layer_idx in range(len(stashed))]
        unit = int(getattr(r.policy, "head_unit", 1))  # a kept context: whole sub-blocks per head
        kept = kept_across_held(
            [layer.scores for layer in stashed], budgets, [layer.judged for layer in stashed], unit
        )
        plan = pooled_plan(r.plan, kept, self.shape.num_kv_heads) if r.final else r.plan
        blocks = (
            first_kept_block(plan, r.shared, r.seq_len, r.spare),
            cdiv(r.seq_len, self.shape.block_size) + r.spare,
        )
        trailing = (self.trailing(r), stashed[0].ranked)
        slots = [layer.slots for layer in stashed]
        moves, placements = place_across_layers(
            self.tables, r.slot, block_row, blocks, kept, slots, trailing, check, r.shared
        )
        held = zip(stashed, placements, strict=True)
        return moves, [placed.held_positions(layer.positions) for layer, placed in held]
