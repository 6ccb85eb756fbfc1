"""Method presets: small YAML files naming a registered method and its parameters (``configs/*.yaml``).

A preset reads::

    method: ada-snapkv
    description: one line saying what the preset is for
    params: {window: 64, kernel: 5, pooling: avg}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vllm_kvevict.policies.base import EvictionPolicy
from vllm_kvevict.policies.registry import build_policy

_KEYS = ("method", "description", "params")


@dataclass(frozen=True)
class Preset:
    """A named method configuration; ``build()`` validates it through the registry."""

    method: str
    params: dict[str, Any]
    description: str = ""

    def build(self) -> EvictionPolicy:
        return build_policy(self.method, **self.params)


def load_preset(path: str | Path) -> Preset:
    """Read and validate one preset file; ValueError names the file and the bad entry."""
    path = Path(path)
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or "method" not in data:
        raise ValueError(f"{path}: a preset is a mapping with keys {', '.join(_KEYS)}; 'method' is required")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(_KEYS)}")
    params = data.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{path}: params={params!r} must be a mapping of parameter names to values")
    preset = Preset(str(data["method"]), dict(params), str(data.get("description", "")))
    try:
        preset.build()
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return preset
