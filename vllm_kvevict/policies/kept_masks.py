"""Turning scores into kept-token masks: top-k, Ada-KV allocation, CriticalKV's two stages, NaCl sampling.

Every function works on a whole layer at once: scores [kv_heads, n] float, ``+inf`` for tokens a method
always keeps (window, sinks), and returns a boolean keep mask [kv_heads, n]. Ties are broken towards the
lower token index (and, across heads, the lower head), so selections are deterministic on every device.
"""

from __future__ import annotations

import torch


def _as_counts(k: int | torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    if isinstance(k, torch.Tensor):
        return k.to(device=device, dtype=torch.int64).reshape(rows)
    return torch.full((rows,), int(k), dtype=torch.int64, device=device)


def top_k_mask(
    scores: torch.Tensor, k: int | torch.Tensor, eligible: torch.Tensor | None = None
) -> torch.Tensor:
    """Keep the ``k`` highest-scoring tokens of each row.

    scores: [rows, n]; k: an int or [rows] int tensor (ragged per row); eligible: optional [rows, n] bool,
    only eligible tokens are chosen (a row never gets more than its eligible count). NaN scores rank last.
    Returns [rows, n] bool with min(k[r], eligible in row r) True entries per row.
    """
    rows, n = scores.shape
    counts = _as_counts(k, rows, scores.device)
    ranked = torch.nan_to_num(scores.float(), nan=float("-inf"))
    # A stable descending sort keeps equal scores in index order: ties go to the lower index.
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices
    if eligible is not None:
        # Then move ineligible tokens behind every eligible one, keeping the score order inside each part.
        ineligible = (~eligible).gather(1, order).to(torch.int8)
        order = order.gather(1, torch.sort(ineligible, dim=1, stable=True).indices)
        counts = torch.minimum(counts, eligible.sum(dim=1))
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n, device=scores.device).expand(rows, n))
    return rank < counts[:, None]


def always_kept_mask(scores: torch.Tensor) -> torch.Tensor:
    """[kv_heads, n] bool: the tokens marked ``+inf`` (window, sinks)."""
    return torch.isposinf(scores)


def safeguard_size(budget: int, alpha: float) -> int:
    """Ada-KV's guaranteed tokens per head: floor(alpha * budget), at least 1 when alpha > 0 (kvpress)."""
    if alpha <= 0 or budget <= 0:
        return 0
    return max(1, int(budget * alpha))


def ada_allocation(scores: torch.Tensor, budget: int, alpha: float) -> torch.Tensor:
    """Ada-KV head-wise selection for one layer: exactly ``kv_heads * budget`` kept tokens in total.

    Each head first keeps its top ``safeguard_size(budget, alpha)`` tokens (and its ``+inf`` ones); the rest
    of the layer's ``H * budget`` slots go to the highest remaining scores of all heads together, so heads
    with concentrated attention give slots to heads with spread attention (Feng et al., 2024, Alg. 1 with
    the safeguard; kvpress's AdaKVPress). B_h <= n holds because a token is chosen at most once.
    scores: [kv_heads, n] with ``+inf`` for always-kept tokens; budget < n. Returns [kv_heads, n] bool.
    """
    kv_heads, n = scores.shape
    guaranteed = top_k_mask(scores, safeguard_size(budget, alpha)) | always_kept_mask(scores)
    remaining = kv_heads * budget - int(guaranteed.sum())
    if remaining < 0:
        raise ValueError(
            f"budget={budget} per head cannot hold the {int(guaranteed.sum())} tokens the {kv_heads} heads "
            "always keep"
        )
    pooled = top_k_mask(scores.reshape(1, -1), remaining, eligible=~guaranteed.reshape(1, -1))
    return guaranteed | pooled.reshape(kv_heads, n)


def blend_budgets(adaptive: torch.Tensor, budget: int, alpha: float) -> torch.Tensor:
    """Per-head budgets ``B_h = alpha * B_h* + (1 - alpha) * budget``, rounded so they sum to H * budget.

    adaptive: [kv_heads] int64 B_h*, the pure Ada-KV allocation (summing to H * budget). Rounding: floor,
    then the heads with the largest fractional parts (ties: the lower head) get one more token each.
    Returns [kv_heads] int64.
    """
    kv_heads = adaptive.shape[0]
    exact = alpha * adaptive.double() + (1.0 - alpha) * budget
    floored = exact.floor().to(torch.int64)
    short = kv_heads * budget - int(floored.sum())
    # A stable sort of the negated remainders puts the largest first, ties in head order.
    order = torch.sort(floored.double() - exact, stable=True).indices
    floored[order[:short]] += 1
    return floored


def ada_blend_allocation(scores: torch.Tensor, budget: int, alpha: float) -> torch.Tensor:
    """Ada-KV's allocation read as a blend: head h keeps its top ``B_h = alpha * B_h* + (1 - alpha) * B``
    tokens, B_h* being the pure allocation (the layer's top H * B scores over all heads, no safeguard).

    alpha is the adaptive share: 0 is uniform SnapKV, 1 pure Ada-KV. Every head keeps at least
    ``(1 - alpha) * B``, so no head is starved. scores: [kv_heads, n] with ``+inf`` for always-kept tokens;
    budget < n. Returns [kv_heads, n] bool with exactly ``kv_heads * budget`` True entries.
    """
    adaptive = ada_allocation(scores, budget, 0.0).sum(dim=1)
    return top_k_mask(scores, blend_budgets(adaptive, budget, alpha))


def critical_selection(
    scores: torch.Tensor,
    norms: torch.Tensor,
    budgets: torch.Tensor,
    first_stage_ratio: float,
    epsilon: float,
    first_stage_floor: int | torch.Tensor = 0,
) -> torch.Tensor:
    """CriticalKV's two-stage selection per head (Feng et al., 2025, "Identify Critical KV Cache").

    Stage 1 keeps the top ``max(floor(B_h * first_stage_ratio), first_stage_floor)`` tokens by attention
    score, counting the always-kept ``+inf`` tokens among them (as kvpress does, whose window scores are
    the maximum); stage 2 fills the rest of B_h with the highest ``(score + epsilon) * norm`` among the
    tokens stage 1 left.
    scores, norms: [kv_heads, n] (norms = ``scoring.value_norms``); budgets: [kv_heads] int64 B_h.
    Returns [kv_heads, n] bool with exactly B_h True entries in row h (B_h <= n).
    """
    budgets = budgets.to(device=scores.device, dtype=torch.int64)
    forced = always_kept_mask(scores)
    stage1_size = torch.floor(budgets.double() * first_stage_ratio).to(torch.int64)
    stage1_size = torch.maximum(stage1_size, _as_counts(first_stage_floor, len(budgets), scores.device))
    stage1_size = torch.minimum(stage1_size, budgets)
    extra = (stage1_size - forced.sum(dim=1)).clamp(min=0)
    stage1 = forced | top_k_mask(scores, extra, eligible=~forced)
    finite = torch.where(forced, 0.0, scores.float())
    critical = (finite + epsilon) * norms.float()
    rest = budgets - stage1.sum(dim=1)
    return stage1 | top_k_mask(critical, rest.clamp(min=0), eligible=~stage1)


def head_seed(seed: int, layer_idx: int, head: int) -> int:
    """A 63-bit generator seed for (seed, layer, head): different per head and layer, stable across runs.

    SplitMix64 finalizer over the three numbers, so neighbouring heads get unrelated streams.
    """
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + layer_idx * 0xBF58476D1CE4E5B9 + head * 0x94D049BB133111EB) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def sample_per_head(
    weights: torch.Tensor, k: int | torch.Tensor, eligible: torch.Tensor, seed: int, layer_idx: int
) -> torch.Tensor:
    """NaCl's random eviction: per head, draw ``k`` eligible tokens without replacement, P ∝ weight.

    weights: [kv_heads, n] >= 0 (the proxy-token attention scores); eligible: [kv_heads, n] bool.
    Each head draws from its own ``torch.Generator`` seeded by ``head_seed(seed, layer_idx, head)``, so the
    sample differs across heads and layers and repeats exactly for the same seed on the same device.
    Zero-weight tokens can still be drawn, with a vanishing probability, once the others run out.
    Returns [kv_heads, n] bool with min(k, eligible count) True entries per row.
    """
    kv_heads, n = weights.shape
    counts = _as_counts(k, kv_heads, weights.device)
    keep = torch.zeros(kv_heads, n, dtype=torch.bool, device=weights.device)
    for head in range(kv_heads):
        candidates = eligible[head].nonzero().squeeze(1)
        draw = min(int(counts[head]), candidates.numel())
        if draw == 0:
            continue
        w = weights[head, candidates].double().clamp(min=0.0)
        # A floor far below any real score keeps multinomial valid when fewer than `draw` weights are > 0.
        w = w + max(float(w.sum()), 1.0) * 1e-12
        generator = torch.Generator(device=weights.device)
        generator.manual_seed(head_seed(seed, layer_idx, head))
        picked = torch.multinomial(w, draw, replacement=False, generator=generator)
        keep[head, candidates[picked]] = True
    return keep


def robust_selection(
    mean: torch.Tensor, std: torch.Tensor, k: int, std_ratio: float, eligible: torch.Tensor
) -> torch.Tensor:
    """RoCo's choice of ``k`` tokens per head among ``eligible`` ones.

    The ``round(std_ratio * k)`` tokens with the most volatile attention (highest std) are outside the
    eviction scope and kept; the rest of k goes to the highest mean attention in the scope.
    mean, std: [kv_heads, n]; eligible: [kv_heads, n] bool. Returns [kv_heads, n] bool.
    """
    protected = top_k_mask(std, round(std_ratio * k), eligible=eligible)
    rest = k - protected.sum(dim=1)
    return protected | top_k_mask(mean, rest, eligible=eligible & ~protected)


def whole_unit_counts(counts: list[int], unit: int, floors: list[int], limit: int) -> list[int]:
    """Per-head counts moved to multiples of ``unit`` with the same sum (a kept context's head budgets:
    every head then fills whole sub-blocks, ``layout/context_reuse.py``).

    counts: [kv_heads] a layer's ragged counts, summing to a multiple of ``unit``; floors: [kv_heads] tokens
    each head must keep (its ``+inf`` ones); limit: the most a head can keep (n, a multiple of ``unit``).
    Each head starts at ``floor(count / unit)`` units (at least ``ceil(floor / unit)``); the units still
    missing go to the heads with the largest remainders, surplus units come from the smallest (ties: the
    lower head). Host ints: a layer has few heads."""
    total, top = sum(counts), limit // unit
    if total % unit or limit % unit:
        raise ValueError(f"counts sum to {total} and limit is {limit}: both must be multiples of {unit}")
    least = [-(-f // unit) for f in floors]
    units = [max(c // unit, lo) for c, lo in zip(counts, least, strict=True)]
    heads = range(len(counts))
    while sum(units) * unit < total:
        open_heads = [h for h in heads if units[h] < top]
        units[max(open_heads, key=lambda h: (counts[h] - units[h] * unit, -h))] += 1
    while sum(units) * unit > total:
        above = [h for h in heads if units[h] > least[h]]
        if not above:
            raise ValueError(f"floors {floors} need more than {total} tokens in multiples of {unit}")
        units[min(above, key=lambda h: (counts[h] - units[h] * unit, h))] -= 1
    return [u * unit for u in units]


def whole_unit_mask(scores: torch.Tensor, keep: torch.Tensor, unit: int) -> torch.Tensor:
    """``keep`` ([kv_heads, n] bool, a layer's ragged selection by ``scores`` [kv_heads, n]) with every head's
    count moved to a multiple of ``unit`` (``whole_unit_counts``), each head keeping its top tokens by
    ``scores``. n and the kept total must be multiples of ``unit``. Returns [kv_heads, n] bool (one read of
    the counts to the host per layer)."""
    kept, floors = torch.stack([keep.sum(dim=1), always_kept_mask(scores).sum(dim=1)]).tolist()
    counts = whole_unit_counts(kept, unit, floors, scores.shape[1])
    return top_k_mask(scores, torch.tensor(counts, device=scores.device))


def across_layers_mask(scores: torch.Tensor, total: int) -> torch.Tensor:
    """The ``total`` highest scores of every layer and head ranked together (``+inf`` ones first; ties to the
    lower layer, head, then token): scores [layers, kv_heads, n] -> [layers, kv_heads, n] bool. What a
    request keeps when its budget is pooled across layers (KVzip's ranking, kvpress ``layerwise=False``,
    with the plan's exact count instead of a ratio)."""
    flat = scores.reshape(1, -1)
    return top_k_mask(flat, min(total, flat.shape[1])).view(scores.shape)
