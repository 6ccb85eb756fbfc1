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


#: element bytes of the unquantised caches an fp8 one is compared with (bf16/fp16: what models serve in)
REFERENCE_ELEMENT_BYTES = 2


def cache_bytes_clause(plan: RequestPlan, bytes_per_block: int, cache_dtype: torch.dtype) -> str:
    """``"; ..."`` appended to the start-up summary: a block's bytes and, for a cache of 1-byte elements
    (vLLM stores every fp8 cache as uint8), how many of ``plan``'s requests the pool holds against an
    unevicted 16-bit cache of the same bytes (eviction's gain x 2). Only the KV-cache spec is read: the
    scheduler's manager is built where vLLM's config is not current (no model dtype, no cache-dtype name)."""
    element = torch.empty(0, dtype=cache_dtype).element_size()
    clause = f"; a {plan.block_size}-token block is {bytes_per_block / 1024:g} KiB over all layers"
    if element >= REFERENCE_ELEMENT_BYTES:
        return clause
    ratio = REFERENCE_ELEMENT_BYTES / element
    gain = cdiv(plan.prompt_len, plan.block_size) / plan.blocks_held(0)
    return (
        f"{clause} ({element}-byte fp8 elements: the pool holds {ratio:g}x the blocks of a 16-bit cache, "
        f"about {gain * ratio:.1f}x such requests of an unevicted bf16/fp16 cache of the same bytes)"
    )
