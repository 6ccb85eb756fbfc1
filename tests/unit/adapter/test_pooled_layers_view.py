"""The fact the pooled sub-block design rests on (``docs/design_modes.md``, "Per-layer block budgets"): vLLM
0.32 keeps every layer's cache in one storage, layer outermost, so the whole allocation viewed as one-head
sub-blocks ``[L·num_blocks·H, 1, 2·bs, D]`` is a cache vLLM's own CPU kernels read and write like a
layer's: a head whose sub-blocks lie in four layers' regions attends exactly as from a cache of its own."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402

from vllm_kvevict.vllm_adapter.cpu_packing import one_head_caches  # noqa: E402

LAYERS, BLOCKS, HEADS, BS, DIM, GROUP, TOKENS = 4, 16, 3, 32, 64, 3, 100
ISAS = ["vec", "amx"] if torch.cpu._is_amx_tile_supported() else ["vec"]


def attend(
    key_cache, value_cache, subblocks: list[int], keys, values, query, isa: str, cache_dtype: str
) -> torch.Tensor:
    """Write ``keys``/``values`` [TOKENS, 1, D] into ``subblocks`` in token order with vLLM's CPU writer, then
    one query [1, GROUP, D] attends them through vLLM's CPU attention (one sequence of one KV head)."""
    tokens = torch.arange(TOKENS)
    slots = torch.tensor(subblocks)[tokens // BS] * BS + tokens % BS
    ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype=cache_dtype
    )
    seq_lens, starts = torch.tensor([TOKENS], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=GROUP, num_kv_heads=1, head_dim=DIM, seq_lens=seq_lens, dtype=query.dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        kv_cache_dtype=cache_dtype,
    )  # fmt: skip
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
        seq_lens=seq_lens, scale=DIM**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.tensor([subblocks], dtype=torch.int32), softcap=0.0, scheduler_metadata=metadata,
        s_aux=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype=cache_dtype,
    )  # fmt: skip
    return out


#: the cache's bytes and how far its attention may be from float32's: bf16 rows, fp8 (e4m3) bytes
CACHES = {"auto": (torch.bfloat16, 5e-3), "fp8": (torch.uint8, 0.06)}


@pytest.mark.parametrize("cache_dtype", list(CACHES))
@pytest.mark.parametrize("isa", ISAS)
def test_a_head_attends_from_other_layers_regions_as_from_its_own_cache(isa: str, cache_dtype: str) -> None:
    if isa == "amx":
        torch.cpu._init_amx()  # the process's permission to use AMX tiles
    torch.manual_seed(0)
    dtype = torch.bfloat16
    storage, tolerance = CACHES[cache_dtype]
    pooled = torch.zeros(LAYERS * BLOCKS, HEADS, BS, 2 * DIM, dtype=storage)  # layer l: pooled[l·BLOCKS:]
    own = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=storage)
    keys, values = torch.randn(TOKENS, 1, DIM, dtype=dtype), torch.randn(TOKENS, 1, DIM, dtype=dtype)
    query = torch.randn(1, GROUP, DIM, dtype=dtype)

    # Sub-block (l·BLOCKS + b)·H + h: head h of block b of layer l; this head's four: layers 2, 0, 3, 1.
    spread = [(2 * BLOCKS + 4) * HEADS + 1, 11 * HEADS + 2, (3 * BLOCKS + 1) * HEADS, (BLOCKS + 6) * HEADS]
    from_pool = attend(*one_head_caches(pooled), spread, keys, values, query, isa, cache_dtype)
    from_own = attend(*one_head_caches(own), [5, 9, 2, 7], keys, values, query, isa, cache_dtype)

    assert torch.equal(from_pool, from_own)
    written = pooled.view(LAYERS, -1).ne(0).any(dim=1)
    assert written.all()  # every layer's region holds part of the head
    reference = torch.softmax(query.float()[0] @ keys.float()[:, 0].T * DIM**-0.5, -1) @ values.float()[:, 0]
    torch.testing.assert_close(from_pool.float()[0], reference, atol=tolerance, rtol=0)


def test_the_pooled_cache_is_every_layer_of_one_storage() -> None:
    from vllm_kvevict.vllm_adapter.pooled_cache import PooledLayoutError, pooled_cache

    storage = torch.arange(LAYERS * BLOCKS * HEADS * BS * 2 * DIM, dtype=torch.float32)
    layers = storage.view(LAYERS, BLOCKS, HEADS, BS, 2 * DIM).unbind(0)  # vLLM's per-layer views
    pooled = pooled_cache(layers[2], 2, LAYERS)
    assert pooled.shape == (LAYERS * BLOCKS, HEADS, BS, 2 * DIM)
    assert pooled.data_ptr() == storage.data_ptr()
    for layer in range(LAYERS):
        assert torch.equal(pooled[layer * BLOCKS : (layer + 1) * BLOCKS], layers[layer])
    with pytest.raises(PooledLayoutError, match="starts at element"):
        pooled_cache(layers[2], 1, LAYERS)  # layer 2's view named as layer 1: not where layer 1 lies
    with pytest.raises(PooledLayoutError, match="storage of"):
        pooled_cache(layers[0], 0, LAYERS + 1)  # more layers than the storage holds
    with pytest.raises(PooledLayoutError, match="not contiguous"):
        pooled_cache(layers[0].transpose(1, 2), 0, LAYERS)
