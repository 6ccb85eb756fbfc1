"""vLLM's side of the eviction configuration: it travels as ``additional_config["kv_eviction"]`` (a plain
dict), which vLLM hands to the API server, the EngineCore and every worker; read and validated here, once per
distinct setting (hot paths call it per layer and step).

No vLLM import: a ``VllmConfig`` is read through its attributes only.
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from typing import Any

from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.parsers import parse_params_json

#: key of the eviction settings inside vLLM's ``additional_config``.
ADDITIONAL_CONFIG_KEY = "kv_eviction"


def eviction_config_from_additional(
    additional_config: dict[str, Any] | None, chunk_stride: int | None = None
) -> EvictionConfig | None:
    """The eviction config inside a vLLM ``additional_config`` dict, or None when eviction is off;
    ``chunk_stride``: the stride where the config leaves it unset (vLLM's chunk size)."""
    raw = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if raw is None:
        return None
    if isinstance(raw, EvictionConfig):
        if raw.chunk_stride is None and chunk_stride is not None:
            return dataclasses.replace(raw, chunk_stride=chunk_stride)
        return raw
    if isinstance(raw, str):
        raw = parse_params_json(raw)
    if isinstance(raw, dict) and not raw:
        return None
    if not isinstance(raw, dict):
        return EvictionConfig.from_dict(raw)
    if raw.get("chunk_stride") is None and chunk_stride is not None:
        raw = {**raw, "chunk_stride": chunk_stride}
    # Called on hot paths (per layer, per step): validate each distinct setting once.
    return eviction_config_from_json(json.dumps(raw, sort_keys=True))


@lru_cache(maxsize=8)
def eviction_config_from_json(text: str) -> EvictionConfig:
    """An EvictionConfig from its JSON dict, validated once per distinct text (hot paths call this)."""
    return EvictionConfig.from_dict(json.loads(text))


def get_eviction_config(vllm_config: Any) -> EvictionConfig | None:
    """The eviction config of a ``VllmConfig`` (None when eviction is off or there is no config)."""
    if vllm_config is None:
        return None
    chunk_size = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    stride = chunk_size if isinstance(chunk_size, int) and chunk_size > 0 else None
    return eviction_config_from_additional(getattr(vllm_config, "additional_config", None), stride)
