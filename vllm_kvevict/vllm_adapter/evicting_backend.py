"""What every evicting attention backend shares, so a backend implements only its platform's cache rows
(read, move, write tokens) and its attention call: the worker's creation with every refusal, its log line
and config metrics; the step lookup and layer index; the head-as-sequence regrouping of queries and
outputs; and the forward dispatch, which after attention makes one call into the step per layer.

A backend mixes ``EvictingBackend``, ``EvictingBuilder`` and ``EvictingImpl`` into vLLM's backend, metadata
builder and attention impl classes (the mixin first) and implements ``EvictingImpl``'s three platform
methods.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_kvevict import metrics
from vllm_kvevict.datapath.attention_metadata import HeadSequenceBatch, StandardPart
from vllm_kvevict.datapath.moves import CacheRows
from vllm_kvevict.datapath.question_echo import EchoLayer
from vllm_kvevict.datapath.step import EvictionStep
from vllm_kvevict.datapath.worker import EvictionWorker
from vllm_kvevict.settings.additional_config import get_eviction_config
from vllm_kvevict.vllm_adapter import model_support
from vllm_kvevict.vllm_adapter.echo_forward import load_chat_marks
from vllm_kvevict.vllm_adapter.kv_spec import EvictingAttentionSpec, evicting_spec_from
from vllm_kvevict.vllm_adapter.learned_scorer import serve_rank_heads
from vllm_kvevict.vllm_adapter.pooled_cache import PooledLayoutError, pooled_cache

logger = init_logger("vllm.kvevict.backend")


@dataclass
class WorkerSlot:
    """The one eviction worker of a model runner, shared by every metadata builder vLLM makes for it (one
    KV cache group holds every layer; a builder per attention group and micro-batch)."""

    worker: EvictionWorker | None = None


#: the slot of the runner whose builders vLLM is making (``builders_share``); None outside that call
_making_builders: ContextVar[WorkerSlot | None] = ContextVar("kvevict_making_builders", default=None)


@contextmanager
def builders_share(slot: WorkerSlot) -> Iterator[WorkerSlot]:
    """The builders made inside share ``slot``'s worker (created by the first, if the slot has none)."""
    token = _making_builders.set(slot)
    try:
        yield slot
    finally:
        _making_builders.reset(token)


def eviction_worker(spec: EvictingAttentionSpec, vllm_config: Any) -> EvictionWorker:
    """The runner's EvictionWorker (``builders_share``), created by its first builder after the refusals of
    a model or configuration no backend can evict correctly. A builder made outside a runner's KV cache
    set-up gets a worker of its own."""
    refusal = model_support.eviction_refusal(vllm_config)
    if refusal is not None:
        raise model_support.ModelRefusedError(refusal)
    slot = _making_builders.get() or WorkerSlot()
    worker = slot.worker
    if worker is None:
        config = spec.eviction
        assert config is not None  # evicting_spec_from sets it
        worker = EvictionWorker(
            policy=config.build_policy(),
            config=config,
            num_layers=spec.num_model_layers,
            num_kv_heads=spec.num_kv_heads,
            block_size=spec.block_size,
            max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
            spare_columns=spec.spare_columns,
            # Set by vLLM's worker before the KV cache (and these builders) are made.
            layer_blocks=vllm_config.cache_config.num_gpu_blocks or 0,
        )
        slot.worker = worker
        serve_rank_heads(vllm_config, spec.num_kv_heads)  # a learned scorer scores this rank's KV heads
        # At start-up, not in the first request: loading the tokenizer took 0.4 s of py-spy samples there.
        worker.use_chat_marks(load_chat_marks(vllm_config))
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


def step_of(layer: torch.nn.Module) -> EvictionStep | None:
    """This step's eviction data for ``layer`` (from the forward context vLLM set for the step)."""
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(layer.layer_name)
    return getattr(metadata, "eviction", None)


class EvictingBackend:
    """Mixed into vLLM's backend class: its impl and builder are the evicting ones, and its KV-cache spec is
    the evicting spec (whose manager frees blocks by the accounting rule)."""

    evicting_impl: type
    evicting_builder: type

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.evicting_impl

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.evicting_builder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return evicting_spec_from(super().customize_spec(spec))  # type: ignore[misc]


class EvictingBuilder:
    """Mixed into vLLM's metadata builder: creates the worker (eviction on) and attaches the step's
    ``EvictionStep`` to the metadata, as ``evicting_metadata(**vLLM's fields, eviction=step)``."""

    evicting_metadata: type  # vLLM's metadata class plus an ``eviction`` field

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)  # type: ignore[call-arg]
        self.worker: EvictionWorker | None = None
        if isinstance(kv_cache_spec, EvictingAttentionSpec):
            self.worker = eviction_worker(kv_cache_spec, vllm_config)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)  # type: ignore[misc]
        if self.worker is None:
            return metadata
        cm = common_attn_metadata
        step = self.worker.make_step(
            cm.num_reqs, cm.num_actual_tokens, cm.seq_lens, cm.block_table_tensor, cm.slot_mapping
        )
        if step is None:
            return metadata
        values = {f.name: getattr(metadata, f.name) for f in fields(metadata)}
        return self.evicting_metadata(**values, eviction=step)


class EvictingImpl:
    """Mixed into vLLM's attention impl. With eviction off every call falls through to vLLM's impl; with
    eviction on a batch without compacted requests runs vLLM's own write and kernel, a batch with compacted
    requests writes and attends "head as sequence", and after attention the step evicts what it must.

    A backend implements ``write_head_tokens``, ``head_attention`` and ``cache_rows``; one that also
    implements ``standard_attention`` (``attends_standard_part``) attends the requests of such a batch that
    are still in the standard layout with its own kernel call (``EvictionStep.split_batch``)."""

    _layer_idx: int | None = None
    #: the backend implements ``standard_attention`` (a mixed batch then makes two kernel calls per layer)
    attends_standard_part: bool = False
    #: the model's layers when requests pool their blocks across them (``budget_scope: "model"``), else 0
    _pooled_layers: int = 0
    #: the whole allocation seen from this layer's cache, and that cache's data pointer (built once)
    _pooled_view: tuple[int, torch.Tensor] | None = None

    # vLLM impl attributes this mixin reads
    num_kv_heads: int
    num_heads: int
    num_queries_per_kv: int
    head_size: int
    attn_type: str
    kv_cache_dtype: str

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config_or_none()
        config = get_eviction_config(vllm_config)
        if config is None:
            return
        refusal = model_support.attention_layer_refusal(
            "(impl)",
            is_decoder=self.attn_type == AttentionType.DECODER,
            alibi_slopes=getattr(self, "alibi_slopes", None),
            sinks=getattr(self, "sinks", None),
            sliding_window=getattr(self, "sliding_window", None),
        ) or model_support.cache_refusal(self.kv_cache_dtype)
        if refusal is not None:
            raise model_support.ModelRefusedError(refusal)
        if config.pools_layers:
            assert vllm_config is not None
            self._pooled_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)

    # ----- platform methods -----------------------------------------------------------------------------
    def write_head_tokens(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Write key/value [T*H, 1, D] to the one-head view of ``kv_cache`` at ``slots`` [T*H]."""
        raise NotImplementedError

    def head_attention(
        self,
        layer: torch.nn.Module,
        step: EvictionStep,
        batch: HeadSequenceBatch,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Attention of (request, KV head) sequences: query/out [T*H, g, D] in sequence order."""
        raise NotImplementedError

    def cache_rows(
        self, layer: torch.nn.Module, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> CacheRows:
        """The layer's cache rows for this step (key/value [T, H, D]: this step's rows)."""
        raise NotImplementedError

    def standard_attention(
        self,
        layer: torch.nn.Module,
        part: StandardPart,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """vLLM's own attention of ``part``'s batch: query/out [T, Hq, D], the standard layout."""
        raise NotImplementedError

    def pooled_refusal(self, layer: torch.nn.Module, kv_cache: torch.Tensor) -> str | None:
        """Why this platform cannot move rows across the pooled allocation of ``kv_cache``'s layers, or
        None (checked once per layer, at the first forward with an allocated cache)."""
        return "this attention backend does not pool blocks across layers"

    # ----- shared ---------------------------------------------------------------------------------------
    def head_cache(self, layer: torch.nn.Module, step: EvictionStep, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache head-as-sequence writes, attention and moves address: the layer's own, or the whole
        allocation when compacted requests' sub-blocks lie in any layer's region (global sub-block ids)."""
        return self.pooled_view(layer, kv_cache) if step.pools_layers else kv_cache

    def pooled_view(self, layer: torch.nn.Module, kv_cache: torch.Tensor) -> torch.Tensor:
        """The whole allocation seen from ``kv_cache`` (``pooled_cache``), checked and built once per cache
        tensor: the warm-up's first forward with an allocated cache refuses a layout that cannot be pooled
        (``PooledLayoutError``), and every step after reuses the view."""
        pointer = kv_cache.data_ptr()
        if self._pooled_view is None or self._pooled_view[0] != pointer:
            view = pooled_cache(kv_cache, self.layer_index(layer), self._pooled_layers)
            refusal = self.pooled_refusal(layer, kv_cache)
            if refusal is not None:
                raise PooledLayoutError(f"budget_scope 'model': {refusal}")
            self._pooled_view = (pointer, view)
        return self._pooled_view[1]

    def layer_index(self, layer: torch.nn.Module) -> int:
        if self._layer_idx is None:
            self._layer_idx = extract_layer_index(layer.layer_name)
        return self._layer_idx

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        step = None if self.attn_type != AttentionType.DECODER else step_of(layer)
        if step is None or not step.has_compacted:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)  # type: ignore[misc]
        # A compacted request's new token goes to the end of each head's own sub-block, not to vLLM's slot
        # (which lies inside sub-blocks holding kept entries): write every token per head on the 1-head view.
        tokens = step.num_tokens
        self.write_head_tokens(
            layer,
            key[:tokens].reshape(tokens * self.num_kv_heads, 1, self.head_size),
            value[:tokens].reshape(tokens * self.num_kv_heads, 1, self.head_size),
            self.head_cache(layer, step, kv_cache),
            step.head_batch(self.layer_index(layer)).slot_mapping,
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
        echo_step = getattr(attn_metadata, "echo_step", None)
        if echo_step is not None:  # the question echo's forward (vllm_adapter/echo_forward.py)
            tokens = echo_step.echo.num_tokens
            tensors = EchoLayer(
                query[:tokens].view(tokens, self.num_heads, self.head_size),
                key[:tokens],
                value[:tokens],
                output[:tokens].view(tokens, self.num_heads, -1),
                self.scale,
                getattr(self, "logits_soft_cap", None),
            )
            rows = self.cache_rows(layer, kv_cache, key[:tokens], value[:tokens])
            echo_step.echo_layer(self.layer_index(layer), tensors, rows)
            return output
        if self._pooled_layers and self._pooled_view is None and kv_cache.numel():
            self.pooled_view(layer, kv_cache)  # refuses an allocation that cannot be pooled, at warm-up
        step = getattr(attn_metadata, "eviction", None)
        args = (layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if step is None or self.attn_type != AttentionType.DECODER:
            return super().forward(*args)  # type: ignore[misc]
        layer_idx = self.layer_index(layer)
        heads_cache = self.head_cache(layer, step, kv_cache)
        if not step.has_compacted:
            super().forward(*args)  # type: ignore[misc]
        elif self.attends_standard_part:
            batch, standard = step.split_batch(layer_idx)
            if standard is not None:  # first: the head-as-sequence call overwrites the compacted rows
                self._standard_attention(layer, step, standard, query, kv_cache, output)
            self._head_sequence_attention(layer, step, batch, query, heads_cache, output)
        else:
            self._head_sequence_attention(layer, step, step.head_batch(layer_idx), query, heads_cache, output)
        if not step.acts_after_attention:
            return output
        tokens = step.num_tokens
        step.after_attention(
            layer_idx,
            query[:tokens].view(tokens, self.num_heads, self.head_size),
            key[:tokens],
            value[:tokens],
            self.cache_rows(layer, heads_cache, key[:tokens], value[:tokens]),
        )
        return output

    def _head_sequence_attention(
        self,
        layer,
        step: EvictionStep,
        batch: HeadSequenceBatch,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Attention of the batch's tokens (``batch.tokens``, else all of them) with each (request, KV head)
        as one sequence.

        query [T, Hq, D] -> [H*T, g, D] head-major (row h*T + t: sequence h*R + r holds request r's tokens
        of head h, the tokens being in request order); the result lands in output [T, Hq, D] the same way."""
        heads, group = self.num_kv_heads, self.num_queries_per_kv
        rows = batch.tokens
        selected = query[: step.num_tokens] if rows is None else query.index_select(0, rows)
        tokens = selected.shape[0]
        grouped = selected.view(tokens, heads, group, self.head_size).transpose(0, 1)
        grouped = grouped.reshape(heads * tokens, group, self.head_size)
        result = torch.empty_like(grouped)
        self.head_attention(layer, step, batch, grouped, kv_cache, result)
        regrouped = result.view(heads, tokens, group, -1).transpose(0, 1)
        if rows is None:
            output[:tokens].view(tokens, heads, group, -1).copy_(regrouped)
        else:
            output.view(output.shape[0], -1).index_copy_(0, rows, regrouped.reshape(tokens, -1))

    def _standard_attention(
        self,
        layer,
        step: EvictionStep,
        part: StandardPart,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """vLLM's attention of the whole step's query into output [T, Hq, D] (the compacted requests' rows
        are dummies, overwritten by the head-as-sequence call after it)."""
        tokens = step.num_tokens
        target = output[:tokens].view(tokens, self.num_heads, self.head_size)
        self.standard_attention(layer, part, query[:tokens], kv_cache, target)
