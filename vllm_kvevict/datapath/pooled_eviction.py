"""A request's blocks pooled across layers (``budget_scope: "model"``, ``docs/design_modes.md``,
"Per-layer block budgets"): the ranking and placement ``executor.AcrossLayers`` runs for every mode.

The entries of every layer and head are ranked together and the best ``H · Σ_l B_l`` kept (the plan's
total), so a layer that needs more of the prompt keeps more and one that needs less gives its share away;
the request's kept blocks hold every layer's sub-blocks (``SubBlockStore`` in pooled mode), about the mean
layer's share instead of the largest one's.

In the compacting step every later layer still writes its prompt into its own region of the request's
blocks, so no layer's entries can move before the last layer has run: each layer's scores are stashed, and
after the last layer's attention they are ranked together (``kept_across_held``), every layer's table is
assigned from the one pool (layer order, then head order, ``place_across_layers``) and one ``Moves`` over the
whole allocation is returned (``vllm_adapter/pooled_cache.py``): sources are read from the cache, all rows
gathered before any is written.

Per chunk, each layer's held entries (the entries it kept at its last eviction, in any layer's region, then
the chunk) are scored by their own cache rows (``entry_scores``), forcing by position what the method always
keeps (``forced_by_position``): ``L · H · a(n1)`` are kept between chunks (the per-layer rule's total, so the
scheduler's offset is unchanged) and ``H · Σ_l B_l`` after the last chunk; a token's score is its own row's,
so after the last chunk a request holds what whole-prompt eviction keeps of the same rows whenever
``a(n) ≥ B'`` (``tests/unit/datapath/test_pooled_worker.py``). A decode cap ranks ``L · H · a(t)`` the same
way (its scorer: ``+inf`` at the sinks and each head's newest ``window``), in the blocks the per-layer rule
keeps (``RequestPlan.blocks_freed``). A kept context's creator (``head_unit`` > 1) keeps every (layer, head)
count in whole sub-blocks, its tokens after the context in pool entries after every layer's context.
"""

from __future__ import annotations

import torch

from vllm_kvevict.datapath.kept_selection import newest_entries
from vllm_kvevict.datapath.moves import Moves
from vllm_kvevict.datapath.placement import Placement, place
from vllm_kvevict.layout.accounting import RequestPlan, adaptive_kept_bound, with_kept_bound
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.shared_prefix import shared_blocks
from vllm_kvevict.policies.base import KeptTokens
from vllm_kvevict.policies.kept_masks import across_layers_mask, whole_unit_mask


def kept_across_layers(
    scores: list[torch.Tensor | None], budgets: tuple[int, ...], heads: int, length: int, unit: int = 1
) -> list[KeptTokens]:
    """Every layer's kept entries of a ``length``-entry prompt: the ``heads · Σ budgets`` best of all layers'
    scores [heads, length] ranked together (``+inf`` ones first), or, when some layer's scores are missing
    (its policy failed), each layer's newest ``budgets[l]`` entries per head (the guard's fallback);
    ``unit``: as ``kept_across_held``."""
    every = torch.ones(heads, length, dtype=torch.bool)
    return kept_across_held(scores, budgets, [every] * len(scores), unit)


def pooled_plan(plan: RequestPlan, kept: list[KeptTokens], heads: int) -> RequestPlan:
    """The plan a pooled request holds blocks by once it kept ``kept`` (every layer's): an adaptive plan's
    (a threshold) at the bound of its mean layer (``accounting.adaptive_kept_bound``), any other itself."""
    if not plan.adaptive:
        return plan
    return with_kept_bound(plan, adaptive_kept_bound(plan, [int(k.counts.sum()) for k in kept], heads))


def kept_across_held(
    scores: list[torch.Tensor | None],
    budgets: tuple[int, ...] | list[int],
    valid: list[torch.Tensor],
    unit: int = 1,
) -> list[KeptTokens]:
    """Every layer's kept entries among what its heads hold: valid[l] [H, W_l] bool marks layer l's held
    entries (False: padding), scores[l] [H, W_l] their scores (``+inf``: always kept; ``-inf``: never, below
    a threshold). The ``H · Σ budgets`` best valid entries of all layers ranked together (fewer where fewer
    score above ``-inf``; ties to the lower layer, head, then entry), or, when
    some layer's scores are missing (its policy failed), each layer's newest ``budgets[l]`` per head.
    ``unit`` > 1 (a kept context, ``KVzap.head_unit``): every (layer, head) count is then moved to a multiple
    of it with the same total (``kept_masks.whole_unit_mask``), each keeping its best entries, so the
    context fills whole sub-blocks. Indices are columns of the held entries, ascending."""
    if any(layer is None for layer in scores):
        return [newest_entries(mask, budget) for mask, budget in zip(valid, budgets, strict=True)]
    heads = valid[0].shape[0]
    width = max(mask.shape[1] for mask in valid)
    padded = torch.full((len(valid), heads, width), float("-inf"), device=valid[0].device)
    held = torch.zeros(len(valid), heads, width, dtype=torch.bool, device=valid[0].device)
    for layer_idx, (layer_scores, mask) in enumerate(zip(scores, valid, strict=True)):
        assert layer_scores is not None
        held[layer_idx, :, : mask.shape[1]] = mask
        padded[layer_idx, :, : mask.shape[1]] = torch.where(mask, layer_scores.float(), float("-inf"))
    candidates = int((held & (padded > float("-inf"))).sum())
    keep = across_layers_mask(padded, min(heads * sum(budgets), candidates)) & held
    if unit > 1:
        units = whole_unit_mask(padded.view(-1, width), keep.view(-1, width), unit)
        keep = units.view(keep.shape) & held
    return [KeptTokens.from_mask(keep[index, :, : mask.shape[1]]) for index, mask in enumerate(valid)]


def place_across_layers(
    tables: BatchSubBlocks,
    slot: int,
    block_row: torch.Tensor,
    blocks: tuple[int, int],
    kept: list[KeptTokens],
    held_slots: list[torch.Tensor],
    trailing: tuple[int, int] = (0, 0),
    check: bool = True,
    shared: int = 0,
) -> tuple[Moves, list[Placement]]:
    """Assign every layer's table of the request in ``slot`` from its one pool and return the moves of its
    kept entries there, with each layer's placement: layer l keeps ``kept[l]`` (columns of its held
    entries, whose slots in the whole allocation are held_slots[l] [H, W_l]) then ``trailing[0]`` entries
    per head from column ``trailing[1]`` on; ``blocks``: (first kept block, blocks the request holds). The
    kept entries of every layer take the pool first, the trailing ones the entries after them (so a kept
    context's blocks hold the context alone); sources are read before any destination is written.
    ``shared``: prompt tokens of a prefix shared through vLLM's prefix cache (whole blocks): every layer's
    table reads those blocks first, in its own region, and its kept entries after them."""
    store = tables.store
    assert store is not None
    heads, bs = store.num_kv_heads, store.block_size
    first_block, num_blocks = blocks
    count, trailing_from = trailing
    assigned, taken = [], 0
    for layer_idx, (layer_kept, slots) in enumerate(zip(kept, held_slots, strict=True)):
        counts = layer_kept.counts.to(device=slots.device, dtype=torch.int64)
        total = int(counts.sum())
        table = store.assign(
            counts,
            block_row,
            first_block,
            0,
            total,
            num_blocks,
            check,
            shared_blocks(shared, bs),
            pool_start=taken,
            group=layer_idx,
        )
        taken += int(table.cursor)
        assigned.append((table, total))
    if count:
        for table, _ in assigned:
            taken += int(store.append_tokens(table, count, block_row, first_block, num_blocks, check, taken))
    sources, destinations, placements = [], [], []
    layers = zip(kept, held_slots, assigned, strict=True)
    for layer_idx, (layer_kept, slots, (table, total)) in enumerate(layers):
        placed = place(layer_kept, count, trailing_from, total + heads * count, slots.device)
        sources.append(slots[placed.heads, placed.chosen])
        destinations.append(placed.destinations(table, bs, shared))
        placements.append(placed)
        tables.commit(layer_idx, slot, table, first_block, pool_cursor=taken)
    return Moves(torch.cat(sources), torch.cat(destinations)), placements
