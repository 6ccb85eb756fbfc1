"""The block accounting rule shared by the scheduler (which frees blocks) and the workers (which compact).

Both sides compute the same plan from the prompt length alone, so no message crosses between them (one
exception, a kept count set by the scores, is at the end).

Let P be the prompt length, bs the block size and B the average kept tokens per KV head. Round B up to
B' in [B, B + bs) so that P - B' is a multiple of bs (the extra tokens are kept, not wasted). Every layer
keeps at most H·B' tokens (exactly H·b_l for its layer budget b_l <= B'). After t generated tokens a layer
needs Σ_h ceil((B_h + t) / bs) < H·((B' + t)/bs + 1) sub-blocks, i.e. at most ceil((B' + t)/bs) + 1 blocks.
So the scheduler frees s = (P - B')/bs - 1 leading blocks once the prompt is processed: the request then
holds ceil((P + t)/bs) - s = ceil((B' + t)/bs) + 1 blocks at every later step — always enough — and vLLM's
ordinary per-position growth hands it the next block exactly when the rule needs it.

Decode-time cap, the same rule extended in time (like vLLM's SlidingWindowManager). Write the plan as an
offset O(t): after t decode tokens a layer holds at most ``H·a(t)`` entries with ``a(t) = P + t - O(t)``, in
the blocks ``[O(t)/bs - 1, ceil((P+t)/bs))`` (O = 0: nothing compacted, nothing freed; a compacted prompt
starts at O0 = P - B'). With cap C and interval k (whole blocks), let F(t) = bs·floor((P + t - C)/bs), the
largest block-aligned offset that still leaves C per head. The first re-score is at the first t >= 1 with
F(t) >= O0 + k (O0 + max(k, 2bs) for a prompt that was not compacted: it must free a block), i.e.
``t1 = max(1, O0 + threshold + C - P)``; from then on ``O(t) = F(t1) + k·floor((F(t) - F(t1))/k)``. At every
t where O grows the worker re-scores each layer and keeps ``<= H·a(t)`` entries (a(t) in [C, C + bs)), and
the scheduler frees ``O(t)/bs - 1`` leading blocks: held blocks stay ``ceil(a(t)/bs) + 1`` as above. After
each step a(t) <= C + k + bs - 1 (C + k - 1 in steady state); right before a re-score, with that step's token,
a head holds at most C + max(k, 2bs) entries (C + k in steady state; C + 2bs when a prompt kept whole is first
cut), unless the prompt itself kept more.

Per-chunk eviction, the same rule before the prompt is complete (chunked prefill). With an intermediate
budget I >= B' (``chunk_budget``), once ``n < P`` prompt tokens are in the cache the offset is
``O(n) = bs·floor((n - I)/bs)`` when that frees at least one block (``O(n) >= 2bs``), else 0: each layer then
holds ``a(n) = n - O(n)`` in [I, I + bs) entries per head, the same count for every head and layer, and the
scheduler frees ``O(n)/bs - 1`` leading blocks, exactly as after the prompt. O is non-decreasing in n and
``O(n) < P - I <= P - B' = O0``, so the prompt's own compaction and the decode cap continue from it. Whatever
the chunk sizes, the worker re-scores a request in the step that moves it from n0 to n1 computed tokens iff
``O(n1) != O(n0)``; during that step a head holds at most I + bs - 1 + (n1 - n0) entries.

With a chunk stride S (``chunk_stride``, vLLM's chunk size unless set) the offset is taken at the last
multiple of S: ``O(n) = O(S·floor(n/S))``. It then moves only when the computed tokens reach a multiple of S,
and the scheduler never lets a chunk run past one (``runner_hooks.split_prefill_chunk``): every eviction sees
the same entries and queries whichever way the token budget cut the prompt, so what a request keeps depends
on the request alone. Between multiples a head holds at most I + bs - 1 + S entries.

With a trailing window w (``trailing_window``, FastKVzip's rule, ``layout/trailing_window.py``) the held
count follows the prompt length instead of I: ``O(n) = min(bs·floor((n - h(n))/bs), O0)`` (again 0 below
2bs), where h(n) holds the tokens before the prompt's last w at r' = (B' - w)/(P - w) (at least the
method's floor) and every arrived token of the window. n - h(n) never decreases (slope 1 - r' before the
window, 0 inside it), so O is non-decreasing; a(n) lies in [h(n), h(n) + bs) and the worker keeps the
arrived part of the window whole among them.

A kept count set by the scores (``EvictionPolicy.adapts_kept_count``: KVzap's threshold) uses the plan as a
ceiling. Layer l keeps k_l <= H·B' entries, which fit the blocks a plan of bound B'_l = align(ceil(k_l/H))
keeps (the rule above with B'_l for B'), so the worker writes them from that plan's first kept block. The
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
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from vllm_kvevict.layout.trailing_window import trailing_window_held
from vllm_kvevict.policies.base import EvictionPolicy


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


#: first re-score of a request without a decode cap: never.
NEVER = 1 << 62


def evicted_offset(prompt_len, offset0, first_rescore, decode_cap, interval, block_size: int, generated):
    """O(t) of the module docstring for ints or numpy arrays (elementwise, one formula for both sides).

    offset0: O0 (P - B' for a compacted prompt, else 0); first_rescore: t1 (``NEVER`` without a cap);
    generated: t, decode tokens in the cache."""
    aligned = block_size * ((prompt_len + generated - decode_cap) // block_size)
    first = block_size * ((prompt_len + first_rescore - decode_cap) // block_size)
    step = np.maximum(interval, 1)
    later = first + step * ((aligned - first) // step)
    return np.where(generated < first_rescore, offset0, later)


@dataclass(frozen=True)
class RequestPlan:
    """What one request keeps and frees.

    layer_budgets: per-layer average kept tokens per KV head (layer l keeps exactly H·layer_budgets[l]).
    kept_bound: B', >= every layer budget, with prompt_len - B' a multiple of block_size.
    blocks_to_free: s, the leading blocks [0, s) the scheduler frees once the prompt is processed.
    compacts: False when the prompt is within budget: the request keeps its full cache, standard layout.
    decode_cap: C, kept tokens per KV head while generating (0: no decode-time cap).
    decode_interval: k, decode tokens between re-scores (a multiple of block_size; 0 without a cap).
    chunk_budget: I, kept tokens per KV head between chunks of a prompt prefilled in several steps
        (>= kept_bound; 0: no such rule, see ``evicts_between_chunks``).
    chunk_stride: S, prompt tokens between evictions before the prompt is complete: the offset moves only
        when the computed tokens reach a multiple of S (0: wherever a chunk ends).
    trailing_window: w > 0: between chunks the prompt's last w tokens are held whole once arrived and the
        tokens before them at r' = (B' - w)/(P - w) (FastKVzip's rule; ``chunk_budget`` is then 0); 0: none.
    trailing_floor: under a trailing window, what each head holds of the tokens before it at least (the
        between-chunks selection's minimum budget).
    adaptive: the policy's scores set each layer's kept count under ``kept_bound`` (a ceiling): the worker
        reports the request's bound after compacting and the scheduler then frees more (module docstring).
    pooled: one budget shared by every layer, the request's blocks pooled across layers (``budget_scope:
        "model"``): its blocks hold other layers' entries, so it never reads or publishes prefix-cache blocks
        (``shared_prefix.reads_prefix_cache``).
    """

    prompt_len: int
    block_size: int
    layer_budgets: tuple[int, ...]
    kept_bound: int
    blocks_to_free: int
    compacts: bool
    decode_cap: int = 0
    decode_interval: int = 0
    chunk_budget: int = 0
    chunk_stride: int = 0
    trailing_window: int = 0
    trailing_floor: int = 0
    adaptive: bool = False
    pooled: bool = False

    @property
    def evicts_between_chunks(self) -> bool:
        """True when a prompt prefilled in several steps is evicted before it is complete (by I or by a
        trailing window)."""
        return bool(self.chunk_budget or self.trailing_window)

    @property
    def offset0(self) -> int:
        """O0: tokens per head evicted from the prompt (P - B' when it compacts)."""
        return self.prompt_len - self.kept_bound if self.compacts else 0

    @property
    def first_rescore(self) -> int:
        """t1: decode tokens after which the first decode-time re-score runs (``NEVER`` without a cap)."""
        if not self.decode_cap:
            return NEVER
        bs, k = self.block_size, self.decode_interval
        threshold = k if self.compacts else max(k, 2 * bs)
        return max(1, self.offset0 + threshold + self.decode_cap - self.prompt_len)

    def offset(self, generated_tokens: int) -> int:
        """O(t): positions per head evicted after ``generated_tokens`` decode tokens are in the cache."""
        return int(
            evicted_offset(
                self.prompt_len,
                self.offset0,
                self.first_rescore,
                self.decode_cap,
                self.decode_interval,
                self.block_size,
                generated_tokens,
            )
        )

    def prefill_offset(self, computed_tokens: int) -> int:
        """O(n) for n = ``computed_tokens`` < P prompt tokens in the cache (per-chunk eviction)."""
        if not self.evicts_between_chunks or computed_tokens >= self.prompt_len:
            return 0
        if self.chunk_stride:  # the last stride point reached: what is evicted depends on positions only
            computed_tokens -= computed_tokens % self.chunk_stride
        held = self.trailing_held(computed_tokens)[0] if self.trailing_window else self.chunk_budget
        aligned = min(self.block_size * ((computed_tokens - held) // self.block_size), self.offset0)
        return aligned if aligned >= 2 * self.block_size else 0

    def trailing_held(self, computed_tokens: int) -> tuple[int, int]:
        """Under a trailing window: (h(n), the arrived tokens of the window among them) after
        ``computed_tokens`` < P prompt tokens (``layout/trailing_window.py``); (n, 0) without one."""
        if not self.trailing_window:
            return computed_tokens, 0
        return trailing_window_held(
            computed_tokens, self.prompt_len, self.kept_bound, self.trailing_window, self.trailing_floor
        )

    def offset_at(self, computed_tokens: int) -> int:
        """O after ``computed_tokens`` tokens (prompt, then generated) are in the cache."""
        if computed_tokens < self.prompt_len:
            return self.prefill_offset(computed_tokens)
        return self.offset(computed_tokens - self.prompt_len)

    def kept_length_at(self, computed_tokens: int) -> int:
        """Entries per KV head (layer average) held after ``computed_tokens`` tokens are in the cache."""
        return computed_tokens - self.offset_at(computed_tokens)

    def blocks_freed_at(self, computed_tokens: int) -> int:
        """Leading blocks freed once ``computed_tokens`` tokens (prompt, then generated) are processed."""
        return max(0, self.offset_at(computed_tokens) // self.block_size - 1)

    def chunk_rescores(self, computed_before: int, computed_after: int) -> bool:
        """True when a step that ends a prompt chunk before the prompt is complete (``computed_after`` < P)
        evicts: the offset moves."""
        if computed_after >= self.prompt_len:
            return False
        return self.prefill_offset(computed_after) != self.prefill_offset(computed_before)

    def kept_length(self, generated_tokens: int) -> int:
        """a(t): a layer holds at most H·a(t) entries after ``generated_tokens`` decode tokens."""
        return self.prompt_len + generated_tokens - self.offset(generated_tokens)

    def rescores_at(self, generated_tokens: int) -> bool:
        """True when the step that brings the cache to ``generated_tokens`` decode tokens re-scores."""
        t = generated_tokens
        return t >= 1 and self.offset(t) != self.offset(t - 1)

    def compacted_at(self, generated_tokens: int) -> bool:
        """True when the request reads per-head sub-blocks once ``generated_tokens`` are in the cache."""
        return self.offset(generated_tokens) > 0

    def blocks_freed(self, generated_tokens: int) -> int:
        """Leading blocks freed once the prompt and ``generated_tokens`` decode tokens are processed."""
        return max(0, self.offset(generated_tokens) // self.block_size - 1)

    def blocks_held(self, generated_tokens: int) -> int:
        """Blocks held after ``generated_tokens`` decode tokens, once the prompt is processed."""
        return cdiv(self.prompt_len + generated_tokens, self.block_size) - self.blocks_freed(generated_tokens)


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
        return dataclasses.replace(
            plan,
            chunk_stride=chunk_stride,
            trailing_window=min(trailing_window, plan.kept_bound),
            trailing_floor=trailing_floor,
        )
    if isinstance(chunk_budget, float):
        tokens = max(int(chunk_budget * plan.kept_bound), CHUNK_BUDGET_FLOOR)
    else:
        tokens = int(chunk_budget)
    return dataclasses.replace(
        plan,
        chunk_budget=max(tokens, plan.kept_bound),
        chunk_stride=chunk_stride,
    )


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
        full = (prompt_len,) * num_layers
        return RequestPlan(prompt_len, block_size, full, prompt_len, 0, False)
    layer_budgets = tuple(
        min(policy.layer_budget(aligned, prompt_len, layer, num_layers), prompt_len)
        for layer in range(num_layers)
    )
    # PyramidKV gives shallow layers more than the average: the bound must cover the largest layer.
    kept_bound = align_budget(prompt_len, max(layer_budgets), block_size)
    if kept_bound >= prompt_len:
        return RequestPlan(prompt_len, block_size, (prompt_len,) * num_layers, prompt_len, 0, False)
    blocks_to_free = max(0, (prompt_len - kept_bound) // block_size - 1)
    if blocks_to_free == 0:
        # Only one block's worth to evict: the rule keeps it as headroom, so eviction would lose tokens and
        # free nothing. Such a request stays whole.
        return RequestPlan(prompt_len, block_size, (prompt_len,) * num_layers, prompt_len, 0, False)
    adaptive = policy.adapts_kept_count
    return RequestPlan(
        prompt_len, block_size, layer_budgets, kept_bound, blocks_to_free, True, adaptive=adaptive,
        pooled=policy.pools_layers,
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
    if plan.pooled:
        mean = cdiv(sum(kept_per_layer), len(kept_per_layer))
        return min(layer_kept_bound(plan.prompt_len, mean, num_kv_heads, plan.block_size), plan.kept_bound)
    bounds = [layer_kept_bound(plan.prompt_len, k, num_kv_heads, plan.block_size) for k in kept_per_layer]
    return min(max(bounds), plan.kept_bound)


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
