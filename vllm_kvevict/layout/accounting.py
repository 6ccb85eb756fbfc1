"""The block accounting rule shared by the scheduler (which frees blocks) and the workers (which compact).

Both sides compute the same plan from the prompt length alone, so no message ever crosses between them.

Let P be the prompt length, bs the block size and B the average kept tokens per KV head. Round B up to
B' in [B, B + bs) so that P - B' is a multiple of bs (the extra tokens are kept, not wasted). Every layer
keeps at most H·B' tokens (exactly H·b_l for its layer budget b_l <= B'). After t generated tokens a layer
needs Σ_h ceil((B_h + t) / bs) < H·((B' + t)/bs + 1) sub-blocks, i.e. at most ceil((B' + t)/bs) + 1 blocks.
So the scheduler frees s = (P - B')/bs - 1 leading blocks once the prompt is processed: the request then
holds ceil((P + t)/bs) - s = ceil((B' + t)/bs) + 1 blocks at every later step — always enough — and vLLM's
ordinary per-position growth hands it the next block exactly when the rule needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

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


@dataclass(frozen=True)
class RequestPlan:
    """What one request keeps and frees.

    layer_budgets: per-layer average kept tokens per KV head (layer l keeps exactly H·layer_budgets[l]).
    kept_bound: B', >= every layer budget, with prompt_len - B' a multiple of block_size.
    blocks_to_free: s, the leading blocks [0, s) the scheduler frees once the prompt is processed.
    compacts: False when the prompt is within budget: the request keeps its full cache, standard layout.
    """

    prompt_len: int
    block_size: int
    layer_budgets: tuple[int, ...]
    kept_bound: int
    blocks_to_free: int
    compacts: bool

    def blocks_held(self, generated_tokens: int) -> int:
        """Blocks held after ``generated_tokens`` decode tokens, once the prompt is processed."""
        return cdiv(self.prompt_len + generated_tokens, self.block_size) - self.blocks_to_free


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
    return RequestPlan(prompt_len, block_size, layer_budgets, kept_bound, blocks_to_free, True)


def request_planner(
    budget: int | float, block_size: int, policy: EvictionPolicy, num_layers: int
) -> Callable[[int], RequestPlan]:
    """``plan_request`` with everything but the prompt length fixed, memoised per prompt length (the
    scheduler and the worker both ask for the same plans on every step)."""

    @lru_cache(maxsize=4096)
    def plan_for(prompt_len: int) -> RequestPlan:
        return plan_request(prompt_len, budget, block_size, policy, num_layers)

    return plan_for
