"""The block rule of a compressed context kept for later requests (per request: ``vllm_xargs.kv_context``).

A request asking ``kv_context: "keep"`` either *creates* an entry (none matched its prompt) or *reads* one.

Creator, a ``P``-token prompt: its context is the block-aligned part, ``P_ctx = bs·floor(P / bs)`` tokens,
planned as a ``P_ctx``-token prompt (``plan_for(P_ctx)``); its last ``P - P_ctx`` (< bs) prompt tokens are
kept after the context like tokens generated later. With a method that keeps the same count in every head
and layer, ``B'`` (the plan's ``kept_bound``) is a multiple of bs (``P_ctx - B'`` is), so each head's kept
entries fill exactly ``m = B' / bs`` sub-blocks and the ``H·m`` context sub-blocks fill exactly the ``m``
blocks ``[s, s + m)`` after the ``s`` freed ones, in pool order (head h owns pool entries ``h·m ... h·m + m -
1``, ``subblock_ids.py``). The creator's later tokens start at pool entry ``H·m``: block ``s + m`` on.
Nothing ever writes blocks ``[s, s + m)`` again, so once the prompt is processed they are the entry.

Reader, a prompt starting with the creator's ``C = P_ctx`` tokens (same setting, same ``cache_salt``): it
gets ``C`` computed tokens held as ``[null] × (C/bs - m)`` then the entry's m blocks (vLLM's block table
stays position-aligned and block-aligned), every head holds ``B'`` entries (table from its own block row,
first pool block ``C/bs - m``) and its own tokens start at column ``C/bs``: fresh blocks, so no shared
block is written. It keeps its own tokens whole (``reader_plan``) and publishes nothing.

Ada-KV keeps ragged counts per head; as it keeps a context (``EvictionPolicy.kept_context_form``) every
head's count is a whole number of blocks and the layer's total is H·B', so the H·m sub-blocks still fill the
m blocks exactly, head h's from pool entry ``Σ_{g<h} B_g / bs`` on, in every layer its own counts. The
scheduler's rule is unchanged; a reader's worker needs the counts, which depend on the creator's scores:
the creator's worker records them by the entry's first block (``EntryCounts``) and the reader's looks them
up there (the same worker process saw the creator, as it sees every request).

Scheduler and workers both apply ``context_plan`` to (setting, prompt length, tokens found in the cache):
a context request only ever starts with cached tokens by reading an entry (it never reads the ordinary
prefix cache), so the role needs no message. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllm_kvevict.layout.request_plan import RequestPlan


def context_len(prompt_len: int, block_size: int) -> int:
    """P_ctx: the block-aligned part of a creator's prompt (its context)."""
    return block_size * (prompt_len // block_size)


def keeps_entry(plan: RequestPlan) -> bool:
    """True when a creator with this context plan leaves an entry: it compacts, every layer keeps the same
    per-head count B', and B' is a whole number of blocks (then the context fills whole blocks)."""
    return (
        plan.compacts
        and not plan.decode_cap
        and not plan.evicts_between_chunks
        and all(budget == plan.kept_bound for budget in plan.layer_budgets)
        and plan.kept_bound % plan.block_size == 0
    )


def reader_plan(prompt_len: int, shared_tokens: int, block_size: int, num_layers: int) -> RequestPlan:
    """A reader's own tokens (after the C entry tokens), kept whole: nothing compacts, nothing is freed."""
    return RequestPlan.whole(max(0, prompt_len - shared_tokens), block_size, num_layers)


def context_plan(
    plan_for: Callable[[int], RequestPlan],
    prompt_len: int,
    shared_tokens: int,
    block_size: int,
    num_layers: int,
) -> RequestPlan:
    """The plan of a context request: a creator's (``shared_tokens == 0``) plans its context ``P_ctx`` when
    that leaves an entry, else its whole prompt as any request; a reader's keeps its own tokens whole."""
    if shared_tokens > 0:
        return reader_plan(prompt_len, shared_tokens, block_size, num_layers)
    plan = plan_for(context_len(prompt_len, block_size))
    return plan if keeps_entry(plan) else plan_for(prompt_len)


@dataclass(frozen=True)
class EntryBlocks:
    """An entry's blocks: columns ``[first, first + count)`` of its creator's block row, and columns
    ``[reader_first, reader_first + count)`` of a reader's, after ``reader_first`` null blocks.
    per_head: B', entries each KV head keeps of the ``context_tokens``-token context."""

    context_tokens: int
    block_size: int
    per_head: int
    first: int

    @property
    def count(self) -> int:
        """m: blocks holding the context's H·m sub-blocks (any split of H·B' among the heads, in blocks)."""
        return self.per_head // self.block_size

    @property
    def reader_first(self) -> int:
        return self.context_tokens // self.block_size - self.count


class EntryCounts:
    """Per-head kept counts [layer][kv head] of the entries this worker's creators left, by the pool block
    id of the entry's first block. A block reclaimed and used by a later creator gets that creator's counts;
    an entry is read only while its blocks are intact (the scheduler's ``KeptContext.intact``), so a
    reader's first block always names the counts of the entry it reads. At most one record per block."""

    def __init__(self) -> None:
        self._by_block: dict[int, list[list[int]]] = {}

    def record(self, first_block_id: int, counts: list[list[int]]) -> None:
        self._by_block[first_block_id] = counts

    def counts_of(self, first_block_id: int) -> list[list[int]]:
        """The counts of the entry starting at pool block ``first_block_id``; raises when none was left."""
        counts = self._by_block.get(first_block_id)
        if counts is None:
            raise RuntimeError(f"no kept context with ragged counts starts at block {first_block_id}")
        return counts


def entry_blocks(plan: RequestPlan) -> EntryBlocks:
    """The entry left by a creator whose context plan is ``plan`` (``keeps_entry``), or read by a reader
    whose setting plans that context so."""
    return EntryBlocks(plan.prompt_len, plan.block_size, plan.kept_bound, plan.blocks_to_free)
