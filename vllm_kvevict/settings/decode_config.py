"""The decode-time cap of the eviction configuration (``EvictionConfig.decode``): which method re-scores
what each KV head holds while generating, down to which cap, how often; validated once when built."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy
from vllm_kvevict.policies.registry import (
    build_decode_policy,
    decode_method_names,
    decode_method_params,
    method_implies_decode_cap,
)
from vllm_kvevict.settings.parsers import EvictionConfigError, method_entry_params, parse_budget

_DECODE_KEYS = ("method", "budget", "interval", "params", "allocation")
#: ``decode.method`` that turns the decode-time cap off (also for the paper methods that imply one).
NO_DECODE = "none"
#: how a layer's decode-time cap is split across its KV heads at a re-score.
DECODE_ALLOCATIONS = ("uniform", "ada")


@dataclass(frozen=True)
class DecodeConfig:
    """The decode-time cap: which method re-scores, the cap per KV head and how often.

    method: a decode method name (``roco``, ``h2o``, ``streamingllm``, ``snapkv``).
    budget: int >= 1 = cap in tokens per KV head while generating; float in (0, 1) = a fraction of the
        prompt length.
    interval: generated tokens between re-scores (None: one block); rounded up to whole blocks.
    params: method parameters, validated by the decode registry.
    allocation: "uniform" (every head capped at the budget) or "ada" (a layer keeps heads x budget,
        split across heads by score at each re-score).
    """

    method: str
    budget: int | float
    interval: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    allocation: str = "uniform"

    def __post_init__(self) -> None:
        names = decode_method_names()
        if self.method not in names:
            raise EvictionConfigError(
                f"kv_eviction.decode.method={self.method!r} is not a known decode method; valid: "
                f"{', '.join([*names, NO_DECODE])}"
            )
        object.__setattr__(self, "budget", parse_budget(self.budget, "kv_eviction.decode.budget"))
        if self.interval is not None and (
            isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1
        ):
            raise EvictionConfigError(
                f"kv_eviction.decode.interval={self.interval!r} is not valid; use an integer >= 1 (generated "
                "tokens between re-scores, rounded up to whole blocks)"
            )
        if self.allocation not in DECODE_ALLOCATIONS:
            raise EvictionConfigError(
                f"kv_eviction.decode.allocation={self.allocation!r} is not valid; valid: "
                f"{', '.join(DECODE_ALLOCATIONS)}"
            )
        if not isinstance(self.params, dict):
            raise EvictionConfigError(f"kv_eviction.decode.params={self.params!r} must be a JSON object")
        try:
            policy = self.build_policy()
            if self.interval is not None:
                policy.check_interval(self.interval)
        except (TypeError, ValueError) as exc:
            raise EvictionConfigError(f"kv_eviction.decode for {self.method!r}: {exc}") from exc
        parse_budget(
            self.budget,
            "kv_eviction.decode.budget",
            minimum=policy.min_cap,
            minimum_kept_by=f"entries {self.method} always keeps",
        )

    def __hash__(self) -> int:  # a key of the policy built once per setting (``params`` is a dict)
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def build_policy(self) -> DecodeEvictionPolicy:
        return build_decode_policy(self.method, **self.params)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> DecodeConfig | None:
        """None for ``{"method": "none"}``."""
        if not isinstance(raw, dict):
            raise EvictionConfigError(
                f"kv_eviction.decode={raw!r} must be a mapping with keys {', '.join(_DECODE_KEYS)}"
            )
        unknown = sorted(set(raw) - set(_DECODE_KEYS))
        if unknown:
            raise EvictionConfigError(
                f"kv_eviction.decode has unknown key(s) {unknown}; valid keys: {', '.join(_DECODE_KEYS)}"
            )
        if raw.get("method") == NO_DECODE:
            return None
        example = "--kv-decode-eviction roco --kv-decode-budget 2048"
        params = method_entry_params(raw, "kv_eviction.decode", example)
        interval = raw.get("interval")
        if isinstance(interval, str) and interval.strip().isdigit():
            interval = int(interval)
        return cls(raw["method"], raw["budget"], interval, params, raw.get("allocation") or "uniform")

    def describe(self) -> str:
        cap = f"{self.budget:.0%} of each prompt" if isinstance(self.budget, float) else f"{self.budget}"
        every = f"every {self.interval} tokens" if self.interval else "every block"
        extra = f" {json.dumps(self.params, sort_keys=True)}" if self.params else ""
        allocation = " (ada allocation)" if self.allocation == "ada" else ""
        return f"decode={self.method} cap={cap} per KV head {every}{allocation}{extra}"


def implied_decode(method: str, budget: int | float, params: dict[str, Any]) -> DecodeConfig | None:
    """The decode-time cap a paper method implies on its own (its prefill budget, its parameters where
    the decode form has them), or None for methods defined after prefill only."""
    if not method_implies_decode_cap(method):
        return None
    known = decode_method_params(method)
    return DecodeConfig(method, budget, None, {k: v for k, v in params.items() if k in known})
