"""The CUDA attention backend with per-head eviction (vLLM 0.32.0 FlashAttention, HND sub-blocks).

vLLM 0.32.0's FlashAttention cache is ``[num_blocks, H, block_size, 2*D]`` (K then V per (block, head)), the
same HND order as the CPU cache, so (block b, head h) is again a sub-block ``b*H + h``: the one-head view
``[num_blocks*H, 1, bs, 2D]``, transposed and split like FlashAttention does, gives key/value caches
``[num_blocks*H, bs, 1, D]``. "Head as sequence" then runs FlashAttention's own varlen paged call with one KV
head, ``group`` query heads, the per-(request, head) sub-block tables and per-head lengths, and
``reshape_and_cache_flash`` writes new tokens on that view. Compaction moves the kept rows inside the cache
with ``layout.kernels.dispatch.compact_subblocks`` (CUDA op where built, else Triton) on the
``[NB*H, bs, 2D]`` sub-block view, K and V together. The orchestration (``eviction_step.py``) is shared with
the CPU backend; its sub-block tables live on the GPU, and a decode step reads nothing back from it.

Registered as ``AttentionBackendEnum.CUSTOM`` (start with ``--attention-backend CUSTOM``). Everything that
needs CUDA or vLLM's FlashAttention build is imported on first use, so this module imports cleanly on a
machine without CUDA: the classes are built by ``backend_classes()`` and exposed lazily as module attributes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any

import torch

from vllm_kvevict.layout.kernels import dispatch
from vllm_kvevict.vllm_adapter.eviction_step import EvictionStep

BACKEND_PATH = "vllm_kvevict.vllm_adapter.backend_cuda.EvictingFlashAttentionBackend"
_LAZY_CLASSES = (
    "EvictingFlashAttentionBackend",
    "EvictingFlashAttentionMetadata",
    "EvictingFlashAttentionMetadataBuilder",
    "EvictingFlashAttentionImpl",
)


def register_cuda_backend() -> None:
    """Point ``AttentionBackendEnum.CUSTOM`` at the evicting FlashAttention backend (import-only; no CUDA)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


def one_head_caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_blocks, H, bs, 2D] -> key and value caches [num_blocks*H, bs, 1, D] (sub-block b*H + h), the
    layout FlashAttention's paged call and ``reshape_and_cache_flash`` take, with one KV head."""
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    view = kv_cache.view(num_blocks * num_kv_heads, 1, block_size, two_d)
    key_cache, value_cache = view.transpose(1, 2).split(two_d // 2, dim=-1)
    return key_cache, value_cache


def __getattr__(name: str) -> Any:
    if name in _LAZY_CLASSES:
        return backend_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def backend_classes() -> dict[str, type]:
    """Build the backend classes (imports vLLM's FlashAttention backend; needs a CUDA build of vLLM)."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
    from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, reshape_and_cache_flash
    from vllm.v1.attention.backends.flash_attn import (
        FlashAttentionBackend,
        FlashAttentionImpl,
        FlashAttentionMetadata,
        FlashAttentionMetadataBuilder,
    )
    from vllm.v1.kv_cache_interface import AttentionSpec

    from vllm_kvevict.vllm_adapter.eviction_step import EvictionWorker, current_worker, set_worker
    from vllm_kvevict.vllm_adapter.kv_spec import EvictingAttentionSpec, evicting_spec_from

    class EvictingFlashAttentionBackend(FlashAttentionBackend):
        """FlashAttention with per-head eviction, registered as ``CUSTOM``."""

        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

        @staticmethod
        def get_impl_cls() -> type:
            return EvictingFlashAttentionImpl

        @staticmethod
        def get_builder_cls() -> type:
            return EvictingFlashAttentionMetadataBuilder

        @classmethod
        def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
            return evicting_spec_from(super().customize_spec(spec))

    @dataclass
    class EvictingFlashAttentionMetadata(FlashAttentionMetadata):
        eviction: EvictionStep | None = None

    class EvictingFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            self.worker: EvictionWorker | None = None
            if isinstance(kv_cache_spec, EvictingAttentionSpec):
                self.worker = current_worker()
                if self.worker is None:
                    config = kv_cache_spec.eviction_config()
                    self.worker = EvictionWorker(
                        policy=config.build_policy(),
                        budget=config.budget,
                        num_layers=kv_cache_spec.num_model_layers,
                        num_kv_heads=kv_cache_spec.num_kv_heads,
                        block_size=kv_cache_spec.block_size,
                        config=config,
                        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
                    )
                    set_worker(self.worker)

        def build(
            self,
            common_prefix_len: int,
            common_attn_metadata: CommonAttentionMetadata,
            fast_build: bool = False,
        ):
            metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
            if self.worker is None:
                return metadata
            cm = common_attn_metadata
            # vLLM's device tensors: the step's tables grow on the GPU (host arrays go over in one copy).
            step = self.worker.make_step(
                cm.num_reqs, cm.num_actual_tokens, cm.seq_lens, cm.block_table_tensor, cm.slot_mapping
            )
            if step is None:
                return metadata
            values = {f.name: getattr(metadata, f.name) for f in fields(FlashAttentionMetadata)}
            return EvictingFlashAttentionMetadata(**values, eviction=step)

    def step_of(layer: torch.nn.Module) -> EvictionStep | None:
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata.get(layer.layer_name)
        return getattr(metadata, "eviction", None)

    class EvictingFlashAttentionImpl(FlashAttentionImpl):
        _layer_idx: int | None = None

        def _layer_index(self, layer: torch.nn.Module) -> int:
            if self._layer_idx is None:
                self._layer_idx = extract_layer_index(layer.layer_name)
            return self._layer_idx

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
            step = None if self.attn_type != AttentionType.DECODER else step_of(layer)
            if step is None or not step.has_compacted:
                return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            batch = step.head_batch(self._layer_index(layer))
            tokens = step.num_tokens
            key_cache, value_cache = one_head_caches(kv_cache)
            reshape_and_cache_flash(
                key[:tokens].reshape(tokens * self.num_kv_heads, 1, self.head_size),
                value[:tokens].reshape(tokens * self.num_kv_heads, 1, self.head_size),
                key_cache,
                value_cache,
                batch.slot_mapping,
                self.kv_cache_dtype,
                layer._k_scale,
                layer._v_scale,
            )

        def forward(
            self,
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            output_scale=None,
            output_block_scale=None,
        ):
            step = getattr(attn_metadata, "eviction", None)
            args = (
                layer,
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                output,
                output_scale,
                output_block_scale,
            )
            if step is None or self.attn_type != AttentionType.DECODER:
                return super().forward(*args)
            layer_idx = self._layer_index(layer)
            if step.has_compacted:
                self._head_sequence_attention(layer, step, layer_idx, query, kv_cache, output)
            else:
                super().forward(*args)
            if step.compacting:
                tokens = step.num_tokens
                # Scoring, selection and the plan stay on the GPU (policies are device-agnostic torch).
                write = step.compact_layer(
                    layer_idx,
                    query[:tokens].view(tokens, self.num_heads, self.head_size),
                    key[:tokens],
                    value[:tokens],
                )
                if write is not None and write.slots.numel():
                    num_blocks, heads, block_size, two_d = kv_cache.shape
                    # view, never reshape: a copy would make the moves land nowhere
                    subblocks = kv_cache.view(num_blocks * heads, block_size, two_d)
                    dispatch.compact_subblocks(subblocks, write.src_slots, write.slots, validate=False)
            if step.chunks:
                self._rescore_chunks(step, layer_idx, query, kv_cache)
            if step.ring_writes is not None:
                tokens = step.num_tokens
                step.record_queries(layer_idx, query[:tokens].view(tokens, self.num_heads, self.head_size))
            if step.rescores:
                self._rescore(step, layer_idx, kv_cache)
            return output

        def _rescore_chunks(self, step: EvictionStep, layer_idx: int, query, kv_cache) -> None:
            """Per-chunk eviction: re-score held entries (K and V read from the cache), move kept rows."""
            num_blocks, heads, block_size, two_d = kv_cache.shape
            subblocks = kv_cache.view(num_blocks * heads, block_size, two_d)
            half = two_d // 2

            def read(slots):
                rows = subblocks[slots // block_size, slots % block_size]
                return rows[:, :half], rows[:, half:]

            tokens = step.num_tokens
            moves = step.rescore_chunks(
                layer_idx, query[:tokens].view(tokens, self.num_heads, self.head_size), read
            )
            if moves is not None and moves.slots.numel():
                dispatch.compact_subblocks(subblocks, moves.src_slots, moves.slots, validate=False)

        def _rescore(self, step: EvictionStep, layer_idx: int, kv_cache) -> None:
            """Decode-time cap: re-score this step's capped requests, move kept rows (K and V together)."""
            num_blocks, heads, block_size, two_d = kv_cache.shape
            subblocks = kv_cache.view(num_blocks * heads, block_size, two_d)
            half = two_d // 2
            moves = step.rescore_layer(
                layer_idx, lambda slots: subblocks[slots // block_size, slots % block_size, :half]
            )
            if moves is not None and moves.slots.numel():
                dispatch.compact_subblocks(subblocks, moves.src_slots, moves.slots, validate=False)

        def _head_sequence_attention(
            self, layer, step: EvictionStep, layer_idx: int, query, kv_cache, output
        ) -> None:
            batch = step.head_batch(layer_idx)
            if batch.kernel_metadata is None:
                # Host bounds, not device maxima: a head never holds more tokens than its request.
                batch.kernel_metadata = (
                    batch.block_table,
                    batch.seq_lens,
                    batch.query_start_loc,
                    step.max_seq_len,
                    step.max_query_len,
                )
            block_table, seq_lens, query_start_loc, max_seqlen_k, max_seqlen_q = batch.kernel_metadata
            tokens, heads, group = step.num_tokens, self.num_kv_heads, self.num_queries_per_kv
            rows = step.sequence_rows()
            grouped = query[:tokens].reshape(tokens * heads, group, self.head_size)
            if rows is not None:
                grouped = grouped.index_select(0, rows)
            result = torch.empty_like(grouped)
            key_cache, value_cache = one_head_caches(kv_cache)
            flash_attn_varlen_func(
                q=grouped,
                k=canonicalize_singleton_dim_strides(key_cache),
                v=canonicalize_singleton_dim_strides(value_cache),
                out=result,
                cu_seqlens_q=query_start_loc,
                max_seqlen_q=max_seqlen_q,
                seqused_k=seq_lens,
                max_seqlen_k=max_seqlen_k,
                softmax_scale=self.scale,
                causal=True,
                block_table=block_table,
                softcap=self.logits_soft_cap,
                fa_version=self.vllm_flash_attn_version,
            )
            flat = output[:tokens].view(tokens * heads, group, -1)
            if rows is None:
                flat.copy_(result)
            else:
                flat.index_copy_(0, rows, result.to(output.dtype))

    return {
        "EvictingFlashAttentionBackend": EvictingFlashAttentionBackend,
        "EvictingFlashAttentionMetadata": EvictingFlashAttentionMetadata,
        "EvictingFlashAttentionMetadataBuilder": EvictingFlashAttentionMetadataBuilder,
        "EvictingFlashAttentionImpl": EvictingFlashAttentionImpl,
    }
