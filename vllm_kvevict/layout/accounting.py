"""How a request's block plan (``request_plan.RequestPlan``, the rule) is made from the eviction setting.

``plan_request`` plans the prompt from its length, the budget and the policy; ``with_decode_cap``,
``with_chunk_budget`` and ``with_kept_bound`` extend a plan to the decode-time cap, per-chunk eviction and
an adaptive request's reported bound; ``request_planner`` memoises the whole for one setting.

A kept count set by the scores (``EvictionPolicy.adapts_kept_count``: KVzap's threshold) uses the plan as a
ceiling. Layer l keeps k_l <= H·B' entries, which fit the blocks a plan of bound B'_l = align(ceil(k_l/H))
keeps (the rule with B'_l for B'), so the worker writes them from that plan's first kept block. The
request then needs only the blocks of its largest layer: the worker reports B'_r = max_l B'_l after the step
(``adaptive_kept_bound``), and the scheduler frees the leading blocks of ``with_kept_bound(plan, B'_r)`` from
then on, a superset of the ceiling's; until the report arrives it holds the ceiling's, which the worker never
writes outside of. Such a request never reads or publishes prefix-cache blocks (``adaptive``). A plan pooled
across layers (``pooled``) keeps K entries of all layers in one pool: B'_r = align(ceil(K / (L·H))), the
mean layer's bound, whose blocks hold L·H·(B'_r + bs) entries, enough for K and every (layer, head)'s last
partial sub-block. With a decode-time cap, both sides run the cap's rule on ``with_kept_bound(plan, B'_r)``
from the report on (its own O0 and first re-score; the worker's ``DecodeSchedule.start_from``); a prompt
recomputed with its cap applied is evicted to the a(t) of ``plan`` and reports no bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import lru_cache

from vllm_kvevict.layout.request_plan import RequestPlan, cdiv
from vllm_kvevict.policies.base import EvictionPolicy


def resolve_token_budget(budget: int | float, prompt_len: int) -> int:
    """Average kept tokens per KV head for a prompt: an int is a token count, a float in (0, 1) a fraction."""
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise ValueError(f"budget={budget!r} must be an int >= 1 or a float in (0, 1)")
    if isinstance(budget, float):
        if not 0.0 < budget < 1.0:
            raise ValueError(f"budget={budget!r}: a fractional budget must lie in (0, 1)")
        return max(1, int(budget * prompt_len))
    if budget < 1:
        raise ValueError(f"budget={budget!r}: a token budget must be >= 1")
    return budget


def align_budget(prompt_len: int, budget: int, block_size: int) -> int:
    """B': the smallest value >= budget with (prompt_len - B') a multiple of block_size, capped at P."""
    if budget >= prompt_len:
        return prompt_len
    return budget + (prompt_len - budget) % block_size


def with_decode_cap(
    plan: RequestPlan, decode_cap: int | float | None, interval: int | None, minimum: int = 0
) -> RequestPlan:
    """``plan`` with a decode-time cap: ``decode_cap`` an int (tokens per KV head) or a float in (0, 1)
    (a fraction of the prompt), at least ``minimum``; ``interval`` rounded up to whole blocks (default one
    block). None: no cap."""
    if decode_cap is None:
        return plan
    bs = plan.block_size
    cap = max(resolve_token_budget(decode_cap, max(plan.prompt_len, 1)), minimum, 1)
    k = bs * max(1, cdiv(interval or bs, bs))
    return dataclasses.replace(plan, decode_cap=cap, decode_interval=k)


#: I given as a multiple of B' is at least this many tokens per KV head. Before the last chunk the question
#: has not been seen, so what is kept is chosen question-agnostic: at 10 % of a 1k prompt 1.5 B' is ~165
#: tokens, and evicting the first 512-token chunk down to that lost 31 (SnapKV) and 10 (Ada-SnapKV) points
#: against whole-prompt eviction (docs/quality.md). An int chunk_budget is taken as given.
CHUNK_BUDGET_FLOOR = 512


def with_chunk_budget(
    plan: RequestPlan,
    chunk_budget: int | float | None,
    chunk_stride: int = 0,
    trailing_window: int = 0,
    trailing_floor: int = 0,
) -> RequestPlan:
    """``plan`` evicting between chunks down to I: ``chunk_budget`` an int (tokens per KV head) or a float
    >= 1 (a multiple of the plan's B', at least ``CHUNK_BUDGET_FLOOR`` tokens), never below B', at every
    multiple of ``chunk_stride`` prompt tokens (0: after every chunk). ``trailing_window`` > 0: FastKVzip's
    rule instead of I (the module docstring), holding at least ``trailing_floor`` of the tokens before the
    window. None, or a prompt kept whole: nothing between chunks."""
    if chunk_budget is None or not plan.compacts:
        return plan
    if trailing_window:
        rule = {"trailing_window": min(trailing_window, plan.kept_bound), "trailing_floor": trailing_floor}
    elif isinstance(chunk_budget, float):
        rule = {"chunk_budget": max(int(chunk_budget * plan.kept_bound), CHUNK_BUDGET_FLOOR, plan.kept_bound)}
    else:
        rule = {"chunk_budget": max(int(chunk_budget), plan.kept_bound)}
    return dataclasses.replace(plan, chunk_stride=chunk_stride, **rule)


def plan_request(
    prompt_len: int, budget: int | float, block_size: int, policy: EvictionPolicy, num_layers: int
) -> RequestPlan:
    """The deterministic plan for a request of ``prompt_len`` tokens (see the module docstring)."""
    if prompt_len < 0 or block_size < 1 or num_layers < 1:
        raise ValueError(
            f"prompt_len={prompt_len}, block_size={block_size}, num_layers={num_layers}: "
            "need prompt_len >= 0, block_size >= 1, num_layers >= 1"
        )
    tokens = resolve_token_budget(budget, prompt_len) if prompt_len else 0
    # A fractional budget of a short prompt can fall below what the method always keeps (its window,
    # sinks): keep that much rather than fail a request mid-flight.
    tokens = max(tokens, int(getattr(policy, "min_budget", 0)))
    aligned = align_budget(prompt_len, tokens, block_size)
    if aligned >= prompt_len:
        return RequestPlan.whole(prompt_len, block_size, num_layers)
    layer_budgets = tuple(
        min(policy.layer_budget(aligned, prompt_len, layer, num_layers), prompt_len)
        for layer in range(num_layers)
    )
    # PyramidKV gives shallow layers more than the average: the bound must cover the largest layer.
    kept_bound = align_budget(prompt_len, max(layer_budgets), block_size)
    blocks_to_free = first_block_for_bound(prompt_len, kept_bound, block_size)
    if blocks_to_free == 0:
        # Nothing to evict, or only one block's worth: the rule keeps it as headroom, so eviction would lose
        # tokens and free nothing. Such a request stays whole.
        return RequestPlan.whole(prompt_len, block_size, num_layers)
    return RequestPlan(
        prompt_len, block_size, layer_budgets, kept_bound, blocks_to_free, True,
        adaptive=policy.adapts_kept_count, pooled=policy.pools_layers,
    )


def layer_kept_bound(prompt_len: int, kept_entries: int, num_kv_heads: int, block_size: int) -> int:
    """B'_l of a layer whose heads keep ``kept_entries`` in all under an adaptive plan: the aligned bound of
    their per-head average (the module docstring)."""
    return align_budget(prompt_len, max(1, cdiv(kept_entries, num_kv_heads)), block_size)


def first_block_for_bound(prompt_len: int, kept_bound: int, block_size: int) -> int:
    """The leading blocks a plan of bound ``kept_bound`` frees: its kept entries start at that block."""
    return max(0, (prompt_len - kept_bound) // block_size - 1)


def adaptive_kept_bound(plan: RequestPlan, kept_per_layer: list[int], num_kv_heads: int) -> int:
    """B'_r of an adaptive plan's request whose layers kept ``kept_per_layer`` entries (all heads): the
    largest layer's bound, or for a plan pooled across layers the mean layer's (its blocks hold every
    layer's entries: L·H·B'_r + L·H·bs entries, more than the kept ones and each head's last partial
    sub-block), never above the ceiling ``plan.kept_bound``."""
    kept = [cdiv(sum(kept_per_layer), len(kept_per_layer))] if plan.pooled else kept_per_layer  # the mean
    bound = max(layer_kept_bound(plan.prompt_len, k, num_kv_heads, plan.block_size) for k in kept)
    return min(bound, plan.kept_bound)


def with_kept_bound(plan: RequestPlan, kept_bound: int) -> RequestPlan:
    """An adaptive ``plan`` once its request reported ``kept_bound`` (<= the ceiling, aligned): the scheduler
    frees the leading blocks this bound leaves."""
    if not plan.adaptive or not plan.compacts:
        raise ValueError("only an adaptive plan that compacts takes a reported kept bound")
    if kept_bound > plan.kept_bound or (plan.prompt_len - kept_bound) % plan.block_size:
        raise ValueError(
            f"kept_bound={kept_bound}: a reported bound must be <= the ceiling {plan.kept_bound} with "
            f"prompt_len - bound a multiple of {plan.block_size}"
        )
    blocks_to_free = first_block_for_bound(plan.prompt_len, kept_bound, plan.block_size)
    layer_budgets = tuple(min(b, kept_bound) for b in plan.layer_budgets)
    return dataclasses.replace(
        plan, kept_bound=kept_bound, blocks_to_free=blocks_to_free, layer_budgets=layer_budgets
    )


def request_planner(
    budget: int | float,
    block_size: int,
    policy: EvictionPolicy,
    num_layers: int,
    decode_cap: int | float | None = None,
    decode_interval: int | None = None,
    decode_min: int = 0,
    chunk_budget: int | float | None = None,
    chunk_stride: int = 0,
    trailing_window: int = 0,
    trailing_floor: int = 0,
) -> Callable[[int], RequestPlan]:
    """``plan_request`` (plus ``with_decode_cap`` and ``with_chunk_budget``) with everything but the prompt
    length fixed, memoised per prompt length (the scheduler and the worker both ask for the same plans on
    every step)."""

    @lru_cache(maxsize=4096)
    def plan_for(prompt_len: int) -> RequestPlan:
        plan = plan_request(prompt_len, budget, block_size, policy, num_layers)
        plan = with_chunk_budget(plan, chunk_budget, chunk_stride, trailing_window, trailing_floor)
        return with_decode_cap(plan, decode_cap, decode_interval, decode_min)

    return plan_for
