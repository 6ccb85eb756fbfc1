"""The eviction configuration every vLLM process agrees on.

It travels as ``additional_config["kv_eviction"]`` (a plain dict), which vLLM hands to the API server, the
EngineCore and every worker. It is validated once, here; the rest of the code trusts it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from vllm_kvevict.policies.base import EvictionPolicy
from vllm_kvevict.policies.presets import Preset, load_preset
from vllm_kvevict.policies.registry import available_methods, build_policy

#: key of the eviction settings inside vLLM's ``additional_config``.
ADDITIONAL_CONFIG_KEY = "kv_eviction"
_KNOWN_KEYS = ("method", "budget", "params")


class EvictionConfigError(ValueError):
    """A bad eviction setting; the message names the field, the bad value and what is allowed."""


def method_names() -> list[str]:
    return [info.name for info in available_methods()]


def parse_budget(raw: Any) -> int | float:
    """``--kv-budget`` value: an int >= 1 (average kept tokens per KV head) or a float in (0, 1) (kept
    fraction of the prompt). Strings are parsed the same way ("1024", "0.25")."""
    value = raw
    if isinstance(raw, str):
        text = raw.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                value = raw
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EvictionConfigError(
            f"kv_eviction.budget={raw!r} is not a number; use an integer >= 1 (kept tokens per KV head) "
            "or a float in (0, 1) (kept fraction of the prompt)"
        )
    if isinstance(value, int):
        if value < 1:
            raise EvictionConfigError(
                f"kv_eviction.budget={raw!r}: an integer budget must be >= 1 (kept tokens per KV head)"
            )
        return value
    if not 0.0 < value < 1.0:
        raise EvictionConfigError(
            f"kv_eviction.budget={raw!r}: a fractional budget must lie in (0, 1); "
            "use an integer for a token count"
        )
    return float(value)


@dataclass(frozen=True)
class EvictionConfig:
    """Which method evicts, with which budget and parameters.

    method: a registered name (``vllm-kvevict methods`` lists them).
    budget: int >= 1 = average kept tokens per KV head; float in (0, 1) = kept fraction of the prompt.
    params: method parameters (window, kernel, alpha, sinks, seed, ...), validated by the policy registry.
    """

    method: str
    budget: int | float
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = method_names()
        if self.method not in names:
            raise EvictionConfigError(
                f"kv_eviction.method={self.method!r} is not a known method; valid: {', '.join(names)}"
            )
        object.__setattr__(self, "budget", parse_budget(self.budget))
        if not isinstance(self.params, dict):
            raise EvictionConfigError(
                f"kv_eviction.params={self.params!r} must be a JSON object such as '{{\"window\": 32}}'"
            )
        try:
            self.build_policy()
        except (TypeError, ValueError) as exc:
            raise EvictionConfigError(f"kv_eviction.params for {self.method!r}: {exc}") from exc

    def build_policy(self) -> EvictionPolicy:
        return build_policy(self.method, **self.params)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "budget": self.budget, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EvictionConfig:
        if not isinstance(raw, dict):
            raise EvictionConfigError(f"kv_eviction={raw!r} must be a mapping with keys {_KNOWN_KEYS}")
        unknown = sorted(set(raw) - set(_KNOWN_KEYS))
        if unknown:
            raise EvictionConfigError(
                f"kv_eviction has unknown key(s) {unknown}; valid keys: {', '.join(_KNOWN_KEYS)}"
            )
        if "method" not in raw or "budget" not in raw:
            raise EvictionConfigError(
                f"kv_eviction={raw!r} needs both 'method' and 'budget' (e.g. --kv-eviction ada-snapkv "
                "--kv-budget 1024)"
            )
        params = raw.get("params") or {}
        if isinstance(params, str):
            params = parse_params_json(params)
        return cls(method=raw["method"], budget=raw["budget"], params=params)

    def describe(self) -> str:
        budget = f"{self.budget:.0%} of each prompt" if isinstance(self.budget, float) else (
            f"{self.budget} tokens per KV head"
        )
        extra = f" {json.dumps(self.params, sort_keys=True)}" if self.params else ""
        return f"method={self.method} budget={budget}{extra}"


def parse_params_json(text: str) -> dict[str, Any]:
    """``--kv-eviction-config`` value: a JSON object of method parameters."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvictionConfigError(
            f"--kv-eviction-config={text!r} is not valid JSON ({exc.msg}); example: '{{\"window\": 32}}'"
        ) from exc
    if not isinstance(value, dict):
        raise EvictionConfigError(
            f"--kv-eviction-config={text!r} must be a JSON object, e.g. '{{\"window\": 32}}'"
        )
    return value


def parse_params_or_preset(text: str) -> dict[str, Any] | Preset:
    """``--kv-eviction-config`` value: a JSON object of method parameters, or the path of a preset file
    (``configs/*.yaml``: method, description, params). Errors name the file and the problem in one line."""
    if text.lstrip().startswith("{"):
        return parse_params_json(text)
    path = Path(text).expanduser()
    try:
        return load_preset(path)
    except FileNotFoundError:
        problem = "no such file (give a preset file such as configs/ada-snapkv.yaml, or a JSON object)"
    except IsADirectoryError:
        problem = "is a directory, not a preset file"
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror or exc})"
    except yaml.YAMLError as exc:
        problem = f"is not valid YAML ({exc})"
    except (TypeError, ValueError) as exc:
        problem = str(exc).removeprefix(f"{path}: ")
    raise EvictionConfigError(f"--kv-eviction-config {text}: {' '.join(problem.split())}")


def eviction_config_from_additional(additional_config: dict[str, Any] | None) -> EvictionConfig | None:
    """The eviction config inside a vLLM ``additional_config`` dict, or None when eviction is off."""
    raw = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if raw is None:
        return None
    if isinstance(raw, EvictionConfig):
        return raw
    if isinstance(raw, str):
        raw = parse_params_json(raw)
    if isinstance(raw, dict) and not raw:
        return None
    if not isinstance(raw, dict):
        return EvictionConfig.from_dict(raw)
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
    return eviction_config_from_additional(getattr(vllm_config, "additional_config", None))
