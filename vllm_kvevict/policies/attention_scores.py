"""Shared scoring blocks: attention of a few queries over a long prompt, pooling, GQA reduction, value norms.

These are the plain-torch references of the Triton scoring kernels. None builds an ``n x n`` matrix: a
prompt longer than one key chunk gets its softmax in two passes (log-sum-exp over the chunks first, then
normalised chunks), and the all-queries forms walk the queries in chunks too, so memory is O(w * n) for
w window queries and O(query_chunk * n) for all of them. Everything is computed in float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.nn import functional as F

from vllm_kvevict.policies.base import check_choice, check_int

POOLING_KINDS: tuple[str, ...] = ("max", "avg")


def check_window_pooling(owner: str, window: object, kernel: object, pooling: object) -> None:
    """Raise ValueError naming ``owner``'s field unless ``window`` is an int >= 1, ``kernel`` an odd int >= 1
    and ``pooling`` one of ``POOLING_KINDS`` (the observation-window parameters of SnapKV-style scoring)."""
    check_int(owner, "window", window, 1)
    check_int(owner, "kernel", kernel, 1)
    if kernel % 2 == 0:
        raise ValueError(f"{owner}: kernel={kernel} is not valid; it must be an odd int >= 1")
    check_choice(owner, "pooling", pooling, POOLING_KINDS)


def _default_positions(num_queries: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n - num_queries, n, device=device)


def _check_shapes(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> None:
    if queries.dim() != 3 or keys.dim() != 3 or queries.shape[2] != keys.shape[2]:
        raise ValueError(
            f"queries must be [q_heads, w, d] and keys [kv_heads, n, d]; got {tuple(queries.shape)} "
            f"and {tuple(keys.shape)}"
        )
    if queries.shape[0] % keys.shape[0] != 0:
        raise ValueError(f"q_heads={queries.shape[0]} is not a multiple of kv_heads={keys.shape[0]}")
    if positions.shape != (queries.shape[1],):
        raise ValueError(f"query_positions must be [w={queries.shape[1]}]; got {tuple(positions.shape)}")


def _attention_probabilities(
    queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, key_chunk: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Causal softmax(q k^T / sqrt(d)) of a query block, yielded one key chunk at a time.

    queries: [kv_heads, g * w, d] float32 (query heads grouped under their KV head, so KV is never repeated)
    keys: [kv_heads, n, d] float32; positions: [g * w] int64.
    Yields (start, probs [kv_heads, g * w, c]) for key chunks [start, start + c).
    """
    n, d = keys.shape[1], keys.shape[2]
    scale = 1.0 / math.sqrt(d)
    first_hidden = int(positions.min()) + 1  # keys before this are visible to every query: no mask needed

    def logits(start: int) -> torch.Tensor:
        chunk = torch.bmm(queries, keys[:, start : start + key_chunk].transpose(1, 2)).mul_(scale)
        end = start + chunk.shape[-1]
        if end > first_hidden:  # only the columns some query cannot see need the mask
            first = max(start, first_hidden)
            key_positions = torch.arange(first, end, device=keys.device)
            hidden = chunk[..., first - start :]
            hidden.masked_fill_(key_positions[None, :] > positions[:, None], float("-inf"))
        return chunk

    if n <= key_chunk:
        yield 0, torch.softmax(logits(0), dim=-1)
        return
    # Pass 1: running log-sum-exp per query row, keeping the chunk logits (O(w * n), like the result).
    # Key 0 is visible to every query, so the running max is finite after the first chunk.
    chunks = []
    running_max = torch.full(queries.shape[:2], float("-inf"), device=keys.device)
    running_sum = torch.zeros(queries.shape[:2], device=keys.device)
    for start in range(0, n, key_chunk):
        chunk = logits(start)
        new_max = torch.maximum(running_max, chunk.amax(dim=-1))
        running_sum = running_sum * torch.exp(running_max - new_max) + torch.exp(
            chunk - new_max[..., None]
        ).sum(dim=-1)
        running_max = new_max
        chunks.append(chunk)
    log_normaliser = (running_max + torch.log(running_sum))[..., None]
    # Pass 2: normalised probabilities chunk by chunk.
    for index, chunk in enumerate(chunks):
        yield index * key_chunk, chunk.sub_(log_normaliser).exp_()


def _grouped(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[q_heads, w, d] -> [kv_heads, g * w, d] float32, query head j under KV head j // g."""
    q_heads, w, d = queries.shape
    return queries.float().reshape(kv_heads, (q_heads // kv_heads) * w, d)


def _column_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    key_chunk: int,
    query_chunk: int,
    heads_per_pass: int | None = None,
) -> torch.Tensor:
    """Sum over queries of causal attention probabilities per query head: [q_heads, n] float32.

    On a CPU one KV head at a time: its group's logits ([g * w, n] float32, 1.3 MB for a 32-query window
    over 3,400 keys of a 3-query group) stay in a core's L2 cache between the matmul, the softmax and the
    sum (on an Intel Xeon with AMX, one thread: 4.1 ms per call for the bundled model's 3 KV heads, 7.3 ms
    with all heads at once; the same sums bit for bit). Elsewhere all heads at once (one launch per op).
    ``heads_per_pass`` (a divisor of kv_heads) overrides that choice.
    """
    q_heads, w, _ = queries.shape
    kv_heads, n, _ = keys.shape
    group = q_heads // kv_heads
    sums = torch.zeros(kv_heads, group, n, device=keys.device)
    step = heads_per_pass or (1 if keys.device.type == "cpu" else kv_heads)
    for first in range(0, kv_heads, step):
        heads = slice(first, first + step)
        head_keys = keys[heads].float()
        head_queries = queries[first * group : (first + step) * group]
        for q_start in range(0, w, query_chunk):
            block = head_queries[:, q_start : q_start + query_chunk]
            c = block.shape[1]
            grouped = _grouped(block, step)
            block_positions = positions[q_start : q_start + c].repeat(group)
            for k_start, probs in _attention_probabilities(grouped, head_keys, block_positions, key_chunk):
                width = probs.shape[-1]
                sums[heads, :, k_start : k_start + width] += probs.view(step, group, c, width).sum(dim=2)
    return sums.reshape(q_heads, n)


def window_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    chunk_size: int = 8192,
) -> torch.Tensor:
    """Mean causal attention of w queries over n keys, per query head.

    queries: [q_heads, w, d]; keys: [kv_heads, n, d] (GQA: query head j reads KV head j // group);
    query_positions: [w] positions of the queries (None: n-w .. n-1); key j is visible to a query at
    position p iff j <= p. Returns [q_heads, n] float32 = mean over the w queries of softmax(q k^T / sqrt(d)).
    The softmax is taken over key chunks of ``chunk_size`` (one plain softmax up to 8k tokens, the bundled
    model's context), never over an n x n matrix: memory O(w * n) per head.
    """
    n = keys.shape[1]
    positions = _positions(query_positions, queries.shape[1], n, keys.device)
    _check_shapes(queries, keys, positions)
    sums = _column_sums(queries, keys, positions, chunk_size, max(1, queries.shape[1]))
    return sums / max(1, queries.shape[1])


def accumulated_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    query_chunk: int = 256,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """H2O's accumulated attention: column sums of the causal attention matrix over all given queries.

    queries: [q_heads, w, d] (w = n for the prefill form: every prompt query); keys: [kv_heads, n, d].
    Returns [q_heads, n] float32. Queries are walked ``query_chunk`` at a time, keys ``chunk_size`` at a
    time, so the n x n matrix never exists.
    """
    n = keys.shape[1]
    positions = _positions(query_positions, queries.shape[1], n, keys.device)
    _check_shapes(queries, keys, positions)
    return _column_sums(queries, keys, positions, chunk_size, query_chunk)


def attention_statistics(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    query_chunk: int = 256,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token attention statistics of each KV head over the queries that can see the token (RoCo).

    A KV head's attention row for a query is the mean over its query group of the query heads' causal
    attention rows (the same row the decode-time ``RocoStatistics.update`` receives). For key j, over the
    ``count[j]`` queries at positions >= j, returns (mean [kv_heads, n], std [kv_heads, n], count [n])
    float32, std being the population standard deviation. Tokens no query sees get 0, 0, 0.
    """
    q_heads, w, _ = queries.shape
    kv_heads, n, _ = keys.shape
    group = q_heads // kv_heads
    positions = _positions(query_positions, w, n, keys.device)
    _check_shapes(queries, keys, positions)
    keys32 = keys.float()
    sums = torch.zeros(kv_heads, n, device=keys.device)
    sq_sums = torch.zeros_like(sums)
    for q_start in range(0, w, query_chunk):
        block = queries[:, q_start : q_start + query_chunk]
        c = block.shape[1]
        block_positions = positions[q_start : q_start + c].repeat(group)
        grouped = _grouped(block, kv_heads)
        for k_start, probs in _attention_probabilities(grouped, keys32, block_positions, chunk_size):
            rows = probs.view(kv_heads, group, c, -1).mean(dim=1)
            width = rows.shape[-1]
            sums[:, k_start : k_start + width] += rows.sum(dim=1)
            sq_sums[:, k_start : k_start + width] += rows.square().sum(dim=1)
    counts = (positions[:, None] >= torch.arange(n, device=keys.device)[None, :]).sum(dim=0).float()
    safe = counts.clamp(min=1.0)
    mean = sums / safe
    variance = (sq_sums / safe - mean.square()).clamp(min=0.0)
    return mean, variance.sqrt(), counts


def _positions(query_positions: torch.Tensor | None, w: int, n: int, device: torch.device) -> torch.Tensor:
    if query_positions is None:
        return _default_positions(w, n, device)
    return query_positions.to(device=device, dtype=torch.int64)


def pool_scores(scores: torch.Tensor, kernel: int = 7, kind: str = "max") -> torch.Tensor:
    """Same-length 1-D pooling along the last axis (SnapKV's clustering of neighbouring tokens).

    scores: [..., n]. kernel: odd window, padding kernel // 2 on both sides. kind "max" pads with -inf
    (edges see only real scores); "avg" matches kvpress's ``F.avg_pool1d(..., stride=1)``: zero padding
    counted in the divisor, so edge scores are damped. Returns [..., n] in the input dtype.
    """
    if kind not in POOLING_KINDS:
        raise ValueError(f"pooling kind={kind!r} is not valid; choose one of {', '.join(POOLING_KINDS)}")
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pooling kernel={kernel!r} is not valid; it must be an odd int >= 1")
    if kernel == 1 or scores.shape[-1] == 0:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    if kind == "max":
        pooled = F.max_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
    else:
        pooled = F.avg_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
    return pooled.reshape(scores.shape)


def extend_forward(scores: torch.Tensor, span: int) -> torch.Tensor:
    """Each token also takes the highest score of the ``span`` tokens before it: [..., n] -> [..., n].

    out[i] = max(scores[i - span .. i]). A kept attention peak then keeps the run of tokens that follows
    it, which is what copying a multi-token value needs: the step writing token k of the value attends to
    the token after the one it just wrote, not to the peak the question pointed at.
    """
    if isinstance(span, bool) or not isinstance(span, int) or span < 0:
        raise ValueError(f"span={span!r} is not valid; it must be an int >= 0")
    if span == 0 or scores.shape[-1] == 0:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    padded = F.pad(flat, (span, 0), value=float("-inf"))
    return F.max_pool1d(padded, kernel_size=span + 1, stride=1).reshape(scores.shape)


def group_mean(scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """GQA reduction: [q_heads, n] -> [kv_heads, n], the mean over each KV head's query group."""
    q_heads, n = scores.shape
    if q_heads % num_kv_heads != 0:
        raise ValueError(f"q_heads={q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return scores.reshape(num_kv_heads, q_heads // num_kv_heads, n).mean(dim=1)


def value_norms(values: torch.Tensor, o_proj: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """CriticalKV's projected value norm per KV head: [kv_heads, n] float32.

    values: [kv_heads, n, d]; o_proj: [hidden, q_heads * d] (the layer's o_proj weight; columns
    j*d:(j+1)*d belong to query head j). For query head j reading KV head h = j // g the norm is
    ||V_h[i] W_O,j^T||_1 over the hidden dimension; a KV head's score is the mean over its g query heads,
    as kvpress's CriticalKVPress averages after repeating KV.
    """
    kv_heads, n, d = values.shape
    hidden = o_proj.shape[0]
    if o_proj.dim() != 2 or o_proj.shape[1] % d != 0 or (o_proj.shape[1] // d) % kv_heads != 0:
        raise ValueError(
            f"o_proj must be [hidden, q_heads * {d}] with q_heads a multiple of kv_heads={kv_heads}; "
            f"got {tuple(o_proj.shape)}"
        )
    q_heads = o_proj.shape[1] // d
    group = q_heads // kv_heads
    # [kv_heads, g, d, hidden]: slice of W_O^T for each query head of the group.
    w_out = o_proj.float().reshape(hidden, kv_heads, group, d).permute(1, 2, 3, 0)
    norms = torch.empty(kv_heads, n, device=values.device)
    for start in range(0, n, chunk_size):
        chunk = values[:, start : start + chunk_size].float()
        projected = torch.einsum("knd,kgdh->kgnh", chunk, w_out)
        norms[:, start : start + chunk.shape[1]] = projected.abs().sum(dim=-1).mean(dim=1)
    return norms
