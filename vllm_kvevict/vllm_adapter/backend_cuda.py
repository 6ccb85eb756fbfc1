"""The GPU attention backend with per-head eviction, on vLLM 0.32.0's Triton attention (``TRITON_ATTN``):
Triton writes the cache (``triton_reshape_and_cache_flash``) and attends (``unified_attention``), so the
backend needs no compiled vLLM op and serves wherever vLLM runs Triton (NVIDIA, AMD).

vLLM's Triton cache is ``[num_blocks, H, block_size, 2*D]`` (K then V per (block, head)), the same HND
order as the CPU cache, so (block b, head h) is a sub-block ``b*H + h``: the one-head view
``[num_blocks*H, 1, bs, 2D]``, transposed and split like the Triton backend does, gives key/value caches
``[num_blocks*H, bs, 1, D]``. "Head as sequence" runs ``unified_attention``'s varlen paged call with one
KV head, ``group`` query heads, the per-(request, head) sub-block tables and per-head lengths. The datapath
moves rows with ``layout.kernels.dispatch.compact_subblocks`` (CUDA op where built, else Triton) on the
``[NB*H, bs, 2D]`` sub-block view, K and V together; its tables live on the GPU and a decode step reads
nothing back from it. Everything else is the shared part (``evicting_backend.py``).

Registered as ``AttentionBackendEnum.CUSTOM`` (``--kv-eviction`` on a GPU sets ``--attention-backend
CUSTOM``). Served on a GPU: not yet (no GPU machine with vLLM has run it; ``docs/deploy.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
from vllm.v1.attention.ops.triton_unified_attention import unified_attention

from vllm_kvevict.datapath.attention_metadata import HeadSequenceBatch
from vllm_kvevict.datapath.moves import CacheRows, Moves
from vllm_kvevict.datapath.step import EvictionStep
from vllm_kvevict.layout.kernels import dispatch
from vllm_kvevict.vllm_adapter.evicting_backend import EvictingBackend, EvictingBuilder, EvictingImpl
from vllm_kvevict.vllm_adapter.quantised_rows import CacheScales, dequantising
from vllm_kvevict.vllm_adapter.vllm_private import kv_scales

BACKEND_PATH = "vllm_kvevict.vllm_adapter.backend_cuda.EvictingTritonAttentionBackend"


def register_cuda_backend() -> None:
    """Point ``AttentionBackendEnum.CUSTOM`` at the evicting Triton backend (import-only; no GPU)."""
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


def subblock_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, H, bs, 2D] -> [num_blocks*H, bs, 2D] (sub-block b*H + h); a view, never a copy (a copy
    would make moves land nowhere), so a cache in another physical order raises here."""
    num_blocks, heads, block_size, two_d = kv_cache.shape
    return kv_cache.view(num_blocks * heads, block_size, two_d)


def one_head_caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_blocks, H, bs, 2D] -> key and value caches [num_blocks*H, bs, 1, D] (sub-block b*H + h), the
    layout ``unified_attention`` and ``triton_reshape_and_cache_flash`` take, with one KV head."""
    two_d = kv_cache.shape[-1]
    return subblock_view(kv_cache).unsqueeze(2).split(two_d // 2, dim=-1)


class GPUCacheRows:
    """The datapath's cache rows on one layer's GPU cache [NB, H, bs, 2D] (K and V of a token adjacent)."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.subblocks = subblock_view(kv_cache)
        self.head_size = kv_cache.shape[-1] // 2

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.reshape(-1)
        rows = self.subblocks[slots // self.subblocks.shape[1], slots % self.subblocks.shape[1]]
        return rows[:, : self.head_size], rows[:, self.head_size :]

    def read_keys(self, slots: torch.Tensor) -> torch.Tensor:
        return self.read(slots)[0]

    def move(self, moves: Moves) -> str:
        return dispatch.compact_subblocks(self.subblocks, moves.src_slots, moves.slots, validate=False)


@dataclass
class EvictingTritonAttentionMetadata(TritonAttentionMetadata):
    """vLLM's Triton metadata plus this step's eviction data (None: a dummy or warm-up batch)."""

    eviction: EvictionStep | None = None


class EvictingTritonAttentionMetadataBuilder(EvictingBuilder, TritonAttentionMetadataBuilder):
    """vLLM's Triton metadata builder that attaches the step's ``EvictionStep`` (eviction on)."""

    evicting_metadata = EvictingTritonAttentionMetadata


class EvictingTritonAttentionImpl(EvictingImpl, TritonAttentionImpl):
    """Triton attention that reads and writes per-head sub-blocks for compacted requests."""

    def write_head_tokens(self, layer, key, value, kv_cache, slots) -> None:
        key_cache, value_cache = one_head_caches(kv_cache)
        triton_reshape_and_cache_flash(
            key, value, key_cache, value_cache, slots, self.kv_cache_dtype, *kv_scales(layer)
        )

    def cache_rows(self, layer, kv_cache, key, value) -> CacheRows:
        fp8 = is_quantized_kv_cache(self.kv_cache_dtype)  # reads of an fp8 cache dequantise
        scales = CacheScales(self.fp8_dtype, *kv_scales(layer)) if fp8 else None
        return dequantising(GPUCacheRows(kv_cache), scales, key.dtype)

    def head_attention(self, layer, step: EvictionStep, batch: HeadSequenceBatch, query, kv_cache, out):
        key_cache, value_cache = one_head_caches(kv_cache)
        if is_quantized_kv_cache(self.kv_cache_dtype):  # the kernel loads fp8-typed caches
            key_cache, value_cache = key_cache.view(self.fp8_dtype), value_cache.view(self.fp8_dtype)
        sequences = batch.seq_lens.shape[0]
        k_scale, v_scale = kv_scales(layer)
        unified_attention(
            q=query,
            k=key_cache,
            v=value_cache,
            out=out,
            cu_seqlens_q=batch.query_start_loc,
            max_seqlen_q=step.max_query_len,  # host bounds, not device maxima: no sync
            seqused_k=batch.seq_lens,
            max_seqlen_k=step.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            window_size=(-1, -1),
            block_table=batch.block_table,
            softcap=self.logits_soft_cap,
            q_descale=None,
            k_descale=k_scale.expand(sequences, 1),
            v_descale=v_scale.expand(sequences, 1),
            kv_quant_mode=self._kv_quant_mode,  # the kernel scales fp8 loads by k/v_descale
        )


class EvictingTritonAttentionBackend(EvictingBackend, TritonAttentionBackend):
    """vLLM's Triton attention with per-head eviction, registered as ``CUSTOM``."""

    evicting_impl = EvictingTritonAttentionImpl
    evicting_builder = EvictingTritonAttentionMetadataBuilder

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"
