"""The KV-cache spec of an evicting layer (``EvictingAttentionSpec``): full attention that carries the
eviction setting, published by each attention layer when eviction is on (``evicting_spec_from``). vLLM's
spec registry gives it its own scheduler-side manager (``evicting_kv_manager.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any

from vllm.config import get_current_vllm_config_or_none
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

from vllm_kvevict.layout.shared_prefix import spare_columns_for
from vllm_kvevict.settings.additional_config import get_eviction_config
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.request_settings import RequestSettings


@dataclass(frozen=True, kw_only=True)
class EvictingAttentionSpec(FullAttentionSpec):
    """Full attention whose prompt cache is evicted per head after prefill.

    eviction: the server's EvictionConfig, typed (specs travel from workers to the EngineCore and back by
        pickle, and must stay hashable: ``EvictionConfig.__hash__``).
    num_model_layers: attention layers of the model (PyramidKV budgets depend on the depth).
    spare_columns: block-table columns each worker row has past ``cdiv(max_len, block_size)``, for the
        spare blocks a compacting request may be given (``shared_prefix.spare_blocks``; 0: prefix caching
        off, never given).
    """

    eviction: EvictionConfig | None = None
    num_model_layers: int = 1
    spare_columns: int = 0

    @classmethod
    def merge(cls, specs: list[EvictingAttentionSpec]) -> EvictingAttentionSpec:
        settings = {(spec.eviction, spec.num_model_layers, spec.spare_columns) for spec in specs}
        if len(settings) != 1:
            raise ValueError(f"all layers of a KV cache group must share one eviction setting: {settings}")
        base = FullAttentionSpec.merge(specs)  # type: ignore[arg-type]
        eviction, num_model_layers, spare_columns = settings.pop()
        inherited = {f.name: getattr(base, f.name) for f in fields(FullAttentionSpec)}
        return cls(
            **inherited, eviction=eviction, num_model_layers=num_model_layers, spare_columns=spare_columns
        )

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        """The worker's block-table width: vLLM's, plus the columns spare blocks may take."""
        return super().max_num_blocks_per_req(vllm_config, max_len) + self.spare_columns


def evicting_spec_from(spec: AttentionSpec) -> AttentionSpec:
    """The spec a layer publishes when eviction is on (called from the attention backend's
    ``customize_spec``); any other spec, or eviction off, passes through unchanged."""
    vllm_config = get_current_vllm_config_or_none()
    config = get_eviction_config(vllm_config)
    if config is None or type(spec) is not FullAttentionSpec:
        return spec
    # `vllm serve` turns chunked prefill off with a log line where it must be; an engine built from Python
    # must do it itself. Prefix caching stays on (shared_prefix.py says which requests read and publish).
    if vllm_config.scheduler_config.enable_chunked_prefill and not config.keeps_chunked_prefill:
        raise ValueError(
            f"kv_eviction with {config.describe()} needs enable_chunked_prefill=False: each prompt is "
            "evicted once, whole; or drop the decode cap"
        )
    inherited = {f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec)}
    num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
    spare_columns = 0
    if vllm_config.cache_config.enable_prefix_caching:
        max_len = vllm_config.model_config.max_model_len
        spare_columns = server_spare_columns(config, spec.block_size, num_layers, max_len)
    return EvictingAttentionSpec(
        **inherited, eviction=config, num_model_layers=num_layers, spare_columns=spare_columns
    )


@functools.lru_cache(maxsize=8)
def server_spare_columns(config: EvictionConfig, block_size: int, num_layers: int, max_len: int) -> int:
    """``shared_prefix.spare_columns_for`` of the server's setting (computed once, not once per layer)."""
    return spare_columns_for(RequestSettings(config, block_size, num_layers).plan_for, max_len)
