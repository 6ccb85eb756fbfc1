"""Method presets: small YAML files naming a registered method and its parameters.

The presets ship inside the package (``vllm_kvevict/presets/*.yaml``, package data; ``configs/`` in a
checkout links there), so ``--kv-eviction-config ada-snapkv`` names one in any install. A preset reads::

    method: ada-snapkv
    description: one line saying what the preset is for
    params: {window: 64, kernel: 5, pooling: avg}
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from vllm_kvevict.policies.base import EvictionPolicy
from vllm_kvevict.policies.registry import build_policy

_KEYS = ("method", "description", "params")
_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class Preset:
    """A named method configuration; ``build()`` validates it through the registry."""

    method: str
    params: dict[str, Any]
    description: str = ""

    def build(self) -> EvictionPolicy:
        return build_policy(self.method, **self.params)


def packaged_presets() -> dict[str, Traversable]:
    """Preset name (the file's stem) -> its file in the installed package, sorted by name."""
    folder = files("vllm_kvevict").joinpath("presets")
    yaml_files = [entry for entry in folder.iterdir() if entry.name.endswith(_SUFFIXES)]
    found = {entry.name.rsplit(".", 1)[0]: entry for entry in yaml_files}
    return dict(sorted(found.items()))


def is_preset_name(text: str) -> bool:
    """A bare word (no path separator, no .yaml/.yml suffix) names a packaged preset; else it is a path."""
    return bool(text) and "/" not in text and "\\" not in text and not text.endswith(_SUFFIXES)


def preset_file(text: str) -> Path | Traversable:
    """The preset file ``text`` means: the packaged preset of that name, or else the path itself.

    LookupError (one line) names an unknown preset and lists the valid names."""
    if not is_preset_name(text):
        return Path(text).expanduser()
    presets = packaged_presets()
    if text not in presets:
        raise LookupError(
            f"no preset named {text!r}; presets: {', '.join(presets)} "
            "(or give a preset file path, or a JSON object)"
        )
    return presets[text]


def load_preset(path: str | Path | Traversable) -> Preset:
    """Read and validate one preset file; ValueError names the file and the bad entry."""
    if isinstance(path, str):
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
