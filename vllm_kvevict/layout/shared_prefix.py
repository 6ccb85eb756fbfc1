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

Prefix reuse is for whole-prompt eviction: a plan that evicts between chunks or while generating rewrites
the blocks it holds over time (and would have to leave the shared ones out of every re-score), so such a
request keeps skipping the prefix cache (``reads_prefix_cache``). Both sides derive everything here from
(prompt length, shared tokens, sampling parameters) and agree without a message: the scheduler takes ``C``
from its cache hit, the worker from the request's computed tokens the first time it sees it.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_kvevict.layout.accounting import RequestPlan


def reads_prefix_cache(plan: RequestPlan) -> bool:
    """True when a request with this (whole-prompt) plan may start from shared cached blocks: it evicts its
    prompt once, after the prompt, and never again."""
    return not plan.decode_cap and not plan.evicts_between_chunks


def private_plan(plan_for: Callable[[int], RequestPlan], prompt_len: int, shared_tokens: int) -> RequestPlan:
    """The plan of the private part of a ``prompt_len``-token prompt whose first ``shared_tokens`` are shared
    cached blocks (``plan_for(prompt_len)`` itself when nothing is shared). A private plan that would evict
    between chunks or while generating keeps its part whole instead (never reached when both sides apply
    ``reads_prefix_cache``; it keeps the accounting safe whatever the plans), and so does a recomputed
    request that found more than its prompt in the cache."""
    if shared_tokens <= 0:
        return plan_for(prompt_len)
    private = max(0, prompt_len - shared_tokens)  # 0: a recomputed request found its whole prompt cached
    plan = plan_for(private)
    if private and reads_prefix_cache(plan):
        return plan
    return RequestPlan(private, plan.block_size, (private,) * len(plan.layer_budgets), private, 0, False)


def shared_blocks(shared_tokens: int, block_size: int) -> int:
    """c: leading blocks shared with other requests (``shared_tokens`` is a whole number of blocks)."""
    if shared_tokens % block_size:
        raise ValueError(f"shared_tokens={shared_tokens} is not a multiple of block_size={block_size}")
    return shared_tokens // block_size


def freed_range(plan: RequestPlan, shared_tokens: int, computed_tokens: int) -> tuple[int, int]:
    """[first, last) blocks the scheduler has freed once ``computed_tokens`` tokens (shared prefix included)
    are processed; ``plan`` is the private plan."""
    first = shared_blocks(shared_tokens, plan.block_size)
    return first, first + plan.blocks_freed_at(max(0, computed_tokens - shared_tokens))


def first_kept_block(plan: RequestPlan, shared_tokens: int, computed_tokens: int) -> int:
    """The first block whose sub-blocks hold the private part's kept entries (the block after the freed
    range)."""
    return freed_range(plan, shared_tokens, computed_tokens)[1]


def publishable_tokens(plan: RequestPlan, shared_tokens: int) -> int | None:
    """Tokens of a request whose blocks may enter the prefix cache: the shared prefix and the private
    blocks freed at compaction (``c + s'`` blocks) for a request that compacts; None (no limit) for one that
    keeps its whole cache; 0 for one that rewrites its blocks over time (it publishes nothing)."""
    if not reads_prefix_cache(plan):
        return 0
    if not plan.compacts:
        return None
    return shared_tokens + plan.blocks_to_free * plan.block_size
