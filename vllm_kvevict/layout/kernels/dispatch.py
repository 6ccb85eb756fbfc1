"""One entry point per paged op, choosing CUDA -> Triton -> torch by device and availability.

Backends:
    cuda    the ``csrc/`` compaction op (compaction only; other ops continue down the chain)
    triton  ``vllm_kvevict/triton_kernels/`` on a CUDA device, or on CPU under Triton's interpreter
            (``TRITON_INTERPRET=1``
            set before triton is imported, as Triton reads it when a kernel is decorated and when it runs)
    torch   ``reference.py``, everywhere
``KVEVICT_KERNEL_BACKEND=cuda|triton|torch|auto`` (default auto) names the first backend to try; naming one
that cannot run here is an error, not a silent fallback. A ``backend=`` argument overrides the variable.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence

import torch

from vllm_kvevict.layout.kernels import cuda_ext, reference
from vllm_kvevict.layout.kernels.views import (
    as_layer_list,
    check_layer_caches,
    check_moves,
    check_sequences,
)

BACKEND_ENV = "KVEVICT_KERNEL_BACKEND"
BACKENDS = ("cuda", "triton", "torch")
CHOICES = ("auto", *BACKENDS)
# which backends implement which op; the chain is tried in BACKENDS order
OPS = {
    "compact_subblocks": ("cuda", "triton", "torch"),
    "ragged_paged_attention": ("triton", "torch"),
    "paged_window_scores": ("triton", "torch"),
}


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def unavailable_reason(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot run on ``device``, or None when it can."""
    if backend == "torch":
        return None
    if backend == "cuda":
        return cuda_ext.unavailable_reason(device)
    if backend == "triton":
        if not _triton_installed():
            return "triton is not installed"
        if device.type == "cuda" or (device.type == "cpu" and triton_interpreted()):
            return None
        return f"triton runs on CUDA devices, or on CPU with TRITON_INTERPRET=1; got {device}"
    raise ValueError(f"kernel backend {backend!r} is not one of {CHOICES}")


def choose_backend(op: str, device: torch.device, backend: str | None = None) -> str:
    """The backend that runs ``op`` on ``device``: the requested one (argument, else the environment
    variable) and, for ops it does not implement, the next one down the chain."""
    if op not in OPS:
        raise ValueError(f"unknown paged op {op!r}; valid are {tuple(OPS)}")
    requested = (backend or os.environ.get(BACKEND_ENV) or "auto").lower()
    if requested not in CHOICES:
        source = "backend argument" if backend else BACKEND_ENV
        raise ValueError(f"{source}={requested!r} is not a kernel backend; valid are {CHOICES}")
    if requested == "auto":
        for candidate in OPS[op]:
            if unavailable_reason(candidate, device) is None:
                return candidate
        raise AssertionError("unreachable: torch is always available")
    candidate = next(b for b in BACKENDS[BACKENDS.index(requested) :] if b in OPS[op])
    reason = unavailable_reason(candidate, device)
    if reason is not None:
        raise RuntimeError(f"kernel backend {candidate!r} was requested for {op} but cannot run: {reason}")
    return candidate


def check_same_dtype(queries: torch.Tensor, *caches: torch.Tensor) -> None:
    """The kernels multiply queries with cache tiles directly: one dtype, one device."""
    for cache in caches:
        if cache.dtype != queries.dtype or cache.device != queries.device:
            raise ValueError(
                f"queries are {queries.dtype} on {queries.device} but the cache is {cache.dtype} on "
                f"{cache.device}; the kernels need both alike (cast the queries to the cache dtype)"
            )


def compact_subblocks(
    caches: torch.Tensor | Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layer_idx: torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> str:
    """In-place compaction of many requests and layers; see ``reference.compact_subblocks``.

    Returns the backend that ran it. validate=False skips the plan checks (range and uniqueness of slots,
    which synchronise with the device) for trusted plans; the torch backend always checks.
    """
    caches = as_layer_list(caches)
    chosen = choose_backend("compact_subblocks", caches[0].device, backend)
    if chosen == "torch":
        reference.compact_subblocks(caches, src_slots, dst_slots, layer_idx)
        return chosen
    if validate:
        check_layer_caches(caches)
        layer_idx = check_moves(caches, src_slots, dst_slots, layer_idx)
    elif layer_idx is None:
        layer_idx = torch.zeros_like(src_slots, dtype=torch.int64)
    layer_idx = layer_idx.to(torch.int64)
    src, dst = src_slots.to(torch.int64).contiguous(), dst_slots.to(torch.int64).contiguous()
    if chosen == "cuda":
        cuda_ext.load_compaction_op()(caches, src, dst, layer_idx.contiguous())
    else:
        from vllm_kvevict.triton_kernels.compaction import compact_slots

        compact_slots(caches, src, dst, layer_idx)
    return chosen


def ragged_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    subblock_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """[T, group, D] attention per (request, KV head) sequence; see ``reference.ragged_paged_attention``.

    validate=False skips the checks (they synchronise with the device) on a hot path with trusted inputs.
    """
    chosen = choose_backend("ragged_paged_attention", query.device, backend)
    if chosen == "torch":
        return reference.ragged_paged_attention(
            query, k_cache, v_cache, subblock_tables, seq_lens, query_start_loc, scale, causal
        )
    if validate:
        check_sequences(k_cache, subblock_tables, seq_lens, v_cache)
        check_same_dtype(query, k_cache, v_cache)
        query_start_loc = reference.check_query_layout(
            query, subblock_tables.shape[0], query_start_loc, k_cache.shape[2]
        )
    elif query_start_loc is None:
        query_start_loc = torch.arange(subblock_tables.shape[0] + 1, device=query.device, dtype=torch.int32)
    from vllm_kvevict.triton_kernels.paged_attention import ragged_paged_attention as triton_attention

    return triton_attention(
        query, k_cache, v_cache, subblock_tables, seq_lens, query_start_loc, scale=scale, causal=causal
    )


def paged_window_scores(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    subblock_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    num_pooled: torch.Tensor | None = None,
    pool_kernel: int = 7,
    pool_kind: str = "max",
    backend: str | None = None,
) -> torch.Tensor:
    """[num_seqs, max_len] observation-window scores per sequence; see ``reference.paged_window_scores``."""
    chosen = choose_backend("paged_window_scores", queries.device, backend)
    if chosen == "torch":
        return reference.paged_window_scores(
            queries, k_cache, subblock_tables, seq_lens, query_positions, num_pooled, pool_kernel, pool_kind
        )
    check_sequences(k_cache, subblock_tables, seq_lens)
    check_same_dtype(queries, k_cache)
    reference.check_window(
        queries, seq_lens, k_cache.shape[2], query_positions, num_pooled, pool_kernel, pool_kind
    )
    from vllm_kvevict.triton_kernels.window_scores import paged_window_scores as triton_scores

    return triton_scores(
        queries, k_cache, subblock_tables, seq_lens, query_positions, num_pooled, pool_kernel, pool_kind
    )
