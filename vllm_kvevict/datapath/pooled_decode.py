"""A decode-time cap on a request whose blocks are pooled across layers (``budget_scope: "model"`` with
``--kv-decode-eviction kvzap``): at each re-score the entries every layer and head holds are ranked together
and the best ``L · H · a(t)`` kept — the per-layer rule's total, so the scheduler frees the blocks the same
rule names (``RequestPlan.blocks_freed``) — in the request's one pool of kept blocks.

Each layer's held entries (their slots of the whole allocation and positions, -1 padded) are scored by the
decode method from their own cache rows (``ScoredDecode.scores``: ``+inf`` at the sinks and each head's
newest ``window``, ``-inf`` at padding) and stashed; no entry moves before the last layer has run (a move
into another layer's region would overwrite rows that layer still reads). After the last layer
``kept_across_held`` ranks them, ``place_across_layers`` assigns every layer's table from the pool and one
``Moves`` over the whole allocation makes them. A scorer that fails on some layer (NaN, an exception) is
logged and counted, and every layer keeps its newest ``a(t)`` entries per head.

A prompt recomputed after preemption whose cap already applies is judged the same way in its own step, over
every row it computed (the prompt and the recomputed output), from the step's keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.decode_schedule import Rescore
from vllm_kvevict.datapath.kept_selection import log_fallback
from vllm_kvevict.datapath.layer_eviction import HeldEntries
from vllm_kvevict.datapath.moves import Moves
from vllm_kvevict.datapath.policy_guard import PolicyFault, guarded, policy_label
from vllm_kvevict.datapath.pooled_eviction import kept_across_held, place_across_layers
from vllm_kvevict.datapath.records import StepTimer
from vllm_kvevict.layout.accounting import RequestPlan, cdiv
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy, gather_padded
from vllm_kvevict.policies.decode.held_layer import HeldLayer


@dataclass(frozen=True)
class StashedHeld:
    """One layer of one capped request until the last layer has run: what its heads hold (slots of the
    whole allocation, positions [H, W], -1 padded) and their scores [H, W] float32 (None: the scorer
    failed)."""

    held: HeldEntries
    scores: torch.Tensor | None


@dataclass(frozen=True)
class PooledTarget:
    """Where a pooled re-score places its kept entries: the request's batch slot and block row, the kept
    blocks ``[first_block, num_blocks)`` of that row, and ``cap`` = a(t), entries per head on average."""

    slot: int
    req_id: str
    block_row: torch.Tensor
    first_block: int
    num_blocks: int
    cap: int

    @staticmethod
    def at(
        slot: int, req_id: str, block_row: torch.Tensor, plan: RequestPlan, generated: int
    ) -> PooledTarget:
        """The target of a request whose plan is ``plan`` once ``generated`` tokens are in the cache: the
        blocks the plan keeps then, and its cap ``a(t)``."""
        num_blocks = cdiv(plan.prompt_len + generated, plan.block_size)
        first_block = plan.blocks_freed(generated)
        return PooledTarget(slot, req_id, block_row, first_block, num_blocks, plan.kept_length(generated))


class PooledDecode:
    """The stashed layers of the step's pooled decode re-scores, by request, and their ranking after the
    last layer."""

    def __init__(self, policy: DecodeEvictionPolicy, shape: CacheShape, tables: BatchSubBlocks) -> None:
        self.policy = policy
        self.shape = shape
        self.tables = tables
        self._stashed: dict[str, list[StashedHeld]] = {}

    def stash(self, layer: HeldLayer, slots: torch.Tensor, req_id: str, cap: int) -> None:
        """Score what ``layer`` holds (positions [H, W] -1 padded, at whole-allocation ``slots`` [H, W]) and
        keep it until the last layer; a failing scorer is logged and counted (``cap``: for the log)."""
        try:
            scores: torch.Tensor | None = self._scores(layer)
        except PolicyFault as exc:
            log_fallback(policy_label(self.policy), req_id, layer.layer_idx, str(exc), cap)
            scores = None
        held = HeldEntries(slots, layer.positions)
        if layer.layer_idx == 0:  # a new re-score: nothing of an earlier, unfinished step is kept
            self._stashed[req_id] = []
        self._stashed.setdefault(req_id, []).append(StashedHeld(held, scores))

    def _scores(self, layer: HeldLayer) -> torch.Tensor:
        """The method's scores [H, W] of ``layer``'s held entries, guarded (NaN, exceptions, shape)."""
        shape = tuple(layer.positions.shape)

        def problem(scores: torch.Tensor) -> str | None:
            found = tuple(scores.shape)
            return None if found == shape else f"scores of shape {found}, the layer holds {shape}"

        return guarded(self.policy, lambda: self.policy.scores(None, layer).float(), problem)

    def compact(self, target: PooledTarget, check: bool) -> tuple[Moves, list[torch.Tensor]]:
        """After the last layer: rank the stashed layers of ``target.req_id`` together (``L · H · cap``
        kept), assign every layer's table in the target's kept blocks and return the moves with the
        positions [H, M] (-1 padded) each layer holds now."""
        stashed = self._stashed.pop(target.req_id)
        layers = self.shape.num_layers
        if len(stashed) != layers:
            raise RuntimeError(f"request {target.req_id}: {len(stashed)} of {layers} layers were scored")
        valid = [layer.held.positions >= 0 for layer in stashed]
        kept = kept_across_held([layer.scores for layer in stashed], [target.cap] * layers, valid)
        moves, _ = place_across_layers(
            self.tables,
            target.slot,
            target.block_row,
            (target.first_block, target.num_blocks),
            kept,
            [layer.held.slots for layer in stashed],
            check=check,
        )
        positions = [
            gather_padded(layer.held.positions, layer_kept.indices, -1)
            for layer, layer_kept in zip(stashed, kept, strict=True)
        ]
        return moves, positions

    def rank(
        self, layer: HeldLayer, slots: torch.Tensor, target: PooledTarget, timer: StepTimer, check: bool
    ) -> tuple[Moves, list[torch.Tensor]] | None:
        """One layer of a pooled re-score (``layer``: what it holds, at whole-allocation ``slots``): stashed;
        after the last layer every layer is ranked, placed in ``target`` and the moves returned with each
        layer's new positions (``compact``); None before the last layer."""
        with timer.phase("selection"):
            self.stash(layer, slots, target.req_id, target.cap)
        if layer.layer_idx < self.shape.num_layers - 1:
            return None
        with timer.phase("selection"):
            return self.compact(target, check)

    def rescore(
        self,
        layer: HeldLayer,
        slots: torch.Tensor,
        r: Rescore,
        block_row: torch.Tensor,
        timer: StepTimer,
        check: bool,
    ) -> Moves | None:
        """One layer of a decode re-score of ``r`` (``rank``, in the blocks the plan keeps at
        ``r.generated``); after the last layer the record holds each layer's new positions."""
        target = PooledTarget.at(r.slot, r.req_id, block_row, r.record.plan, r.generated)
        ranked = self.rank(layer, slots, target, timer, check)
        if ranked is None:
            return None
        moves, positions = ranked
        r.record.positions = list(positions)
        return moves
