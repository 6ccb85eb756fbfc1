"""What a KV-cache block weighs, for the start-up summary line and the saved-bytes gauge: eviction's gains
are counted in blocks of the pool, and an fp8 cache (``--kv-cache-dtype fp8``) makes each block half the bytes
of a bf16 one, so the same pool holds twice the blocks; the two gains multiply."""

from __future__ import annotations

import torch

from vllm_kvevict.layout.accounting import RequestPlan, cdiv


def block_bytes(page_size_bytes: int, num_layers: int) -> int:
    """Bytes of one block of the pool over every layer of this worker (vLLM's per-layer ``page_size_bytes``:
    K and V of ``block_size`` tokens and this rank's KV heads, in the cache's own dtype)."""
    return page_size_bytes * num_layers


def cache_bytes_clause(
    plan: RequestPlan,
    kv_cache_dtype: str,
    bytes_per_block: int,
    cache_dtype: torch.dtype,
    model_dtype: torch.dtype | None,
) -> str:
    """``"; ..."`` appended to the start-up summary: a block's bytes and, for a quantised cache (element
    ``cache_dtype`` narrower than the model's), how many of ``plan``'s requests the pool holds against an
    unevicted cache in the model dtype of the same bytes (eviction's gain x the element-size ratio)."""
    kib = bytes_per_block / 1024
    clause = f"; a {plan.block_size}-token block is {kib:g} KiB over all layers ({kv_cache_dtype} cache)"
    element, model_element = _itemsize(cache_dtype), _itemsize(model_dtype) if model_dtype else None
    if model_element is None or element >= model_element:
        return clause
    ratio = model_element / element
    gain = cdiv(plan.prompt_len, plan.block_size) / plan.blocks_held(0)
    model_name = str(model_dtype).removeprefix("torch.")
    return (
        f"{clause}, {element / model_element:g}x a {model_name} block: the pool holds {ratio:g}x the blocks, "
        f"about {gain * ratio:.1f}x such requests of an unevicted {model_name} cache of the same bytes"
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
