"""The block accounting rule shared by the scheduler (which frees blocks) and the workers (which compact):
``RequestPlan``, what one request keeps and frees at every step; ``accounting.py`` makes the plans.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_kvevict.layout.trailing_window import trailing_window_held


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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

    @classmethod
    def whole(cls, prompt_len: int, block_size: int, num_layers: int) -> RequestPlan:
        """A request that keeps its full cache in the standard layout: nothing compacts, nothing is freed."""
        return cls(prompt_len, block_size, (prompt_len,) * num_layers, prompt_len, 0, False)

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
        return int(evicted_offset(
            self.prompt_len, self.offset0, self.first_rescore, self.decode_cap, self.decode_interval,
            self.block_size, generated_tokens,
        ))

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
        return self.kept_length_at(self.prompt_len + generated_tokens)

    def rescores_at(self, generated_tokens: int) -> bool:
        """True when the step that brings the cache to ``generated_tokens`` decode tokens re-scores."""
        t = generated_tokens
        return t >= 1 and self.offset(t) != self.offset(t - 1)

    def compacted_at(self, generated_tokens: int) -> bool:
        """True when the request reads per-head sub-blocks once ``generated_tokens`` are in the cache."""
        return self.offset(generated_tokens) > 0

    def blocks_freed(self, generated_tokens: int) -> int:
        """Leading blocks freed once the prompt and ``generated_tokens`` decode tokens are processed."""
        return self.blocks_freed_at(self.prompt_len + generated_tokens)

    def blocks_held(self, generated_tokens: int) -> int:
        """Blocks held after ``generated_tokens`` decode tokens, once the prompt is processed."""
        return cdiv(self.prompt_len + generated_tokens, self.block_size) - self.blocks_freed(generated_tokens)
