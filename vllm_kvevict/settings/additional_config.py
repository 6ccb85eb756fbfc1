"""The one serialised form of the server's setting (``to_wire``/``from_wire``), where a process boundary
demands it: vLLM hands ``additional_config["kv_eviction"]`` (plain JSON values; vLLM hashes and pickles it) to
every process, the API servers read its JSON text from the environment. Past it the setting travels typed
(``EvictionConfig``, in the KV-cache spec to the scheduler and workers). No vLLM import."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.parsers import parse_params_json

#: key of the eviction settings inside vLLM's ``additional_config``.
ADDITIONAL_CONFIG_KEY = "kv_eviction"


def to_wire(config: EvictionConfig) -> dict[str, Any]:
    """The setting as plain JSON values (``from_wire`` reads it back to an equal config)."""
    return config.to_dict()


def from_wire(raw: Any, chunk_stride: int | None = None) -> EvictionConfig | None:
    """The setting from its wire form (a dict, its JSON text or an EvictionConfig; None or {}: eviction off),
    validated once per distinct setting and process (hot paths call this per layer and step);
    ``chunk_stride``: where the setting leaves it unset (vLLM's chunk size)."""
    if isinstance(raw, EvictionConfig):
        raw = to_wire(raw)
    elif isinstance(raw, str):
        raw = parse_params_json(raw)
    if raw is None or isinstance(raw, dict) and not raw:
        return None
    if not isinstance(raw, dict):
        return EvictionConfig.from_dict(raw)
    if raw.get("chunk_stride") is None and chunk_stride is not None:
        raw = {**raw, "chunk_stride": chunk_stride}
    return _validated(json.dumps(raw, sort_keys=True))


@lru_cache(maxsize=8)
def _validated(text: str) -> EvictionConfig:
    return EvictionConfig.from_dict(json.loads(text))


def eviction_config_from_additional(
    additional_config: dict[str, Any] | None, chunk_stride: int | None = None
) -> EvictionConfig | None:
    """The eviction config inside a vLLM ``additional_config`` dict, or None when eviction is off."""
    return from_wire((additional_config or {}).get(ADDITIONAL_CONFIG_KEY), chunk_stride)


def with_eviction(additional_config: dict[str, Any] | None, config: EvictionConfig) -> dict[str, Any]:
    """A copy of vLLM's ``additional_config`` carrying ``config`` in its wire form."""
    return {**(additional_config or {}), ADDITIONAL_CONFIG_KEY: to_wire(config)}


def get_eviction_config(vllm_config: Any) -> EvictionConfig | None:
    """The eviction config of a ``VllmConfig`` (None when eviction is off or there is no config)."""
    if vllm_config is None:
        return None
    chunk_size = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    stride = chunk_size if isinstance(chunk_size, int) and chunk_size > 0 else None
    return eviction_config_from_additional(getattr(vllm_config, "additional_config", None), stride)
