"""The one executor of every eviction mode. A mode (whole prompt, per chunk, the echo, a decode cap, a prompt
recomputed under its cap) describes one layer of one request as a ``LayerWork``: the entries its heads hold,
the choice (scorer and budget), where the kept entries go, and what the mode records once they are placed.
``LayerCommit`` runs it: guarded selection -> sub-block assignment -> placement -> ``Moves``. How a layer
commits is the one strategy chosen once per worker (``layer_commit``): on its own right after its attention
(``EachLayer``), or, where a request's blocks are pooled across layers, stashed with its scores until the
last layer and ranked with every other layer (``AcrossLayers``, ``pooled_eviction.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.kept_selection import LayerChoice, kept_or_newest
from vllm_kvevict.datapath.layer_eviction import HeldEntries, LayerTables, LayerTarget
from vllm_kvevict.datapath.moves import Moves
from vllm_kvevict.datapath.placement import Placement, place
from vllm_kvevict.datapath.pooled_eviction import kept_across_held, place_across_layers
from vllm_kvevict.datapath.step_timer import StepTimer
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.policies.base import KeptTokens

#: what a mode records of one placed layer: the choice's kept (indices into the held entries, counts [H])
#: and their placement (kept then trailing entries, head-major)
OnPlaced = Callable[[KeptTokens, Placement], None]


@dataclass(frozen=True)
class LayerWork:
    """One layer of one request to evict: ``held`` (slots in the view ``LayerCommit.view`` gave), the
    ``choice`` judging its first ``held.width - target.trailing`` entries, the ``target`` its kept entries
    go to, and ``placed``, called once the layer's kept entries have their places."""

    layer_idx: int
    held: HeldEntries
    choice: LayerChoice
    target: LayerTarget
    placed: OnPlaced

    @property
    def scored(self) -> int:
        """Held entries per head the choice judges (the trailing ones are kept whole after them)."""
        return self.held.width - self.target.trailing

    def judged(self) -> torch.Tensor:
        """[H, scored] bool: the held entries the choice may keep (False: padding, a shared prefix)."""
        valid = self.held.positions[:, : self.scored] >= 0
        valid[:, : self.target.shared] = False
        return valid


class EachLayer:
    """Every layer commits on its own, right after its attention: ``choice`` (guarded, or the newest entries
    when it fails), its table (a group of layers sharing one is assigned at its first layer, committed
    after its last), the kept entries placed in it and the moves to them (sources and destinations may
    overlap: gather, then scatter)."""

    across_layers = False

    def __init__(self, tables: LayerTables, timer: StepTimer) -> None:
        self.tables = tables
        self.timer = timer

    def view(self, held: HeldEntries, layer_idx: int) -> HeldEntries:
        """``held`` as this strategy moves it: in the layer's own cache."""
        return held

    def run(self, work: LayerWork) -> Moves:
        held, choice, layer_idx, tables = work.held, work.choice, work.layer_idx, self.tables
        heads, device, block_size = held.slots.shape[0], held.slots.device, tables.tables.block_size
        with self.timer.phase("selection"):
            kept = kept_or_newest(choice, work.judged(), work.target.req_id, layer_idx)
        total = heads * choice.budget if choice.exact else int(kept.counts.sum())  # host-known when exact
        target = work.target.for_kept(total, heads, block_size)
        counts = kept.counts.to(device=device, dtype=torch.int64)
        table = tables.table_for(layer_idx, target, counts, total, getattr(choice.policy, "name", "?"))
        placed = place(kept, target.trailing, work.scored, total + heads * target.trailing, device)
        src = held.slots[placed.heads, placed.chosen]
        destinations = placed.destinations(table, block_size, target.shared)
        tables.commit(layer_idx, target)
        work.placed(kept, placed)
        if held.step_row is None:
            return Moves(src, destinations)
        rows = held.positions[placed.heads, placed.chosen] + held.step_row
        return Moves(src, destinations, rows, placed.heads)


class AcrossLayers:
    """A request's blocks pooled across layers: each layer's held entries are scored and stashed (no entry
    may move before the last layer ran: a move into another layer's region would overwrite rows it still
    reads); after the last layer every layer and head is ranked together, the ``H · Σ_l budget_l`` best kept
    (``kept_across_held``), every layer's table assigned from the request's one pool and one ``Moves`` over
    the whole allocation returned (``place_across_layers``)."""

    across_layers = True

    def __init__(self, tables: LayerTables, shape: CacheShape, timer: StepTimer) -> None:
        self.tables = tables
        self.shape = shape
        self.timer = timer
        self._stashed: dict[str, list[tuple[LayerWork, torch.Tensor | None]]] = {}

    def view(self, held: HeldEntries, layer_idx: int) -> HeldEntries:
        """``held`` with slots of the whole allocation (``global_entries``)."""
        return global_entries(self.tables.tables, self.shape, layer_idx, held, held.in_store)

    def run(self, work: LayerWork) -> Moves | None:
        """Stash ``work``'s scores; after the last layer, rank, place and move every layer of its request."""
        req_id = work.target.req_id
        with self.timer.phase("selection"):
            scores = work.choice.scores(req_id)
            if scores is not None:
                scores = torch.nn.functional.pad(scores, (work.scored - scores.shape[1], 0), value=-torch.inf)
        if work.layer_idx == 0:  # a new re-score: nothing of an earlier, unfinished step is kept
            self._stashed[req_id] = []
        stashed = self._stashed.setdefault(req_id, [])
        stashed.append((work, scores))
        if work.layer_idx < self.shape.num_layers - 1:
            return None
        del self._stashed[req_id]
        if len(stashed) != self.shape.num_layers:
            layers = self.shape.num_layers
            raise RuntimeError(f"request {req_id}: {len(stashed)} of {layers} layers were scored")
        with self.timer.phase("selection"):
            return self._rank([w for w, _ in stashed], [s for _, s in stashed])

    def _rank(self, works: list[LayerWork], scores: list[torch.Tensor | None]) -> Moves:
        first, target = works[0], works[0].target
        budgets = [w.choice.budget for w in works]
        kept = kept_across_held(scores, budgets, [w.judged() for w in works], first.choice.head_unit)
        first_block = target.pooled_first(kept) if target.pooled_first is not None else target.first_block
        moves, placements = place_across_layers(
            self.tables.tables,
            target.slot,
            target.block_row,
            (first_block, target.num_blocks),
            kept,
            [w.held.slots for w in works],
            (target.trailing, first.scored),
            self.tables.check,
            target.shared,
        )
        for work, layer_kept, placed in zip(works, kept, placements, strict=True):
            work.placed(layer_kept, placed)
        return moves


LayerCommit = EachLayer | AcrossLayers


def global_entries(
    tables: BatchSubBlocks, shape: CacheShape, layer_idx: int, held: HeldEntries, compacted: bool
) -> HeldEntries:
    """``held`` of ``layer_idx`` with slots of the whole allocation: a request still in vLLM's layout holds
    its rows in its layer's own region (the store's rows of a compacted one are global already)."""
    if compacted:
        return held
    region = tables.layer_blocks * shape.num_kv_heads * shape.block_size
    return HeldEntries(held.slots + layer_idx * region, held.positions, held.step_row, in_store=True)


def layer_commit(tables: LayerTables, shape: CacheShape, timer: StepTimer) -> LayerCommit:
    """The step's strategy, the same for every request and mode: ranked across layers where the store pools
    a request's blocks across layers (``BatchSubBlocks.layer_blocks``), else each layer on its own."""
    if tables.tables.layer_blocks:
        return AcrossLayers(tables, shape, timer)
    return EachLayer(tables, timer)
