"""User-facing decode-time method names -> configured policies. A new method = its file + one line here; the
decode form of a prefill method that scores each entry with no queries = one line here (``DecodeForm``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_kvevict.policies.decode.decode_h2o import DecodeH2O
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy
from vllm_kvevict.policies.decode.decode_roco import DecodeRoCo
from vllm_kvevict.policies.decode.decode_scored import ScoredDecode
from vllm_kvevict.policies.decode.decode_snapkv import DecodeSnapKV
from vllm_kvevict.policies.decode.decode_streamingllm import DecodeStreamingLLM
from vllm_kvevict.policies.kvzap import KVzap


@dataclass(frozen=True)
class DecodeForm:
    """A decode method that is ``ScoredDecode`` around prefill class ``inner``: its parameters are the
    inner's but ``dropped`` ones (a mode a decode cap cannot run, e.g. kvzap's threshold: the cap's count is
    known before the scores), plus ``alpha`` (default ``ada_alpha``) when ``ada``: Ada-KV caps."""

    inner: type
    ada: bool = False
    dropped: tuple[str, ...] = ()
    ada_alpha: float = 0.2

    def params(self) -> dict[str, Any]:
        inner = {f.name: f.default for f in dataclasses.fields(self.inner) if f.name not in self.dropped}
        return {**inner, "alpha": self.ada_alpha} if self.ada else inner

    def __call__(self, **params: Any) -> ScoredDecode:
        alpha = params.pop("alpha", self.ada_alpha) if self.ada else None
        return ScoredDecode(self.inner(**params), alpha)


_Builder = type[DecodeEvictionPolicy] | DecodeForm
_METHODS: dict[str, tuple[_Builder, str]] = {
    "roco": (DecodeRoCo, "mean attention of the queries that saw an entry, volatile ones kept, plus recent"),
    "h2o": (DecodeH2O, "heavy hitters by accumulated attention, plus recent"),
    "streamingllm": (DecodeStreamingLLM, "first entries (attention sinks) plus the most recent ones"),
    "snapkv": (DecodeSnapKV, "attention of the last window queries, pooled; keeps the window"),
    "kvzap": (
        DecodeForm(KVzap, dropped=("threshold", "threshold_scope", "budget_scope", "head_unit")),
        "the learned scorer's score of each held entry",
    ),
    "ada-kvzap": (
        DecodeForm(KVzap, True, ("threshold", "threshold_scope", "budget_scope", "head_unit")),
        "kvzap's scores, caps split across heads (Ada-KV)",
    ),
}


def decode_method_names() -> list[str]:
    return list(_METHODS)


def decode_method_description(name: str) -> str:
    return _method(name)[1]


def decode_method_params(name: str) -> dict[str, Any]:
    """The parameters of method ``name`` with their defaults."""
    builder = _method(name)[0]
    if isinstance(builder, DecodeForm):
        return builder.params()
    return {f.name: f.default for f in dataclasses.fields(builder)}


def build_decode_policy(name: str, **params: Any) -> DecodeEvictionPolicy:
    """The decode-time method registered as ``name`` with ``params`` overriding its defaults.

    Raises ValueError for an unknown name or parameter (listing the valid ones) or a bad value (naming it).
    """
    build: Callable[..., DecodeEvictionPolicy] = _method(name)[0]
    known = decode_method_params(name)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} for decode method {name!r}; "
            f"valid parameters: {', '.join(known) or '(none)'}"
        )
    policy = build(**params)
    policy.name = name
    return policy


def _method(name: str) -> tuple[_Builder, str]:
    if name not in _METHODS:
        raise ValueError(f"unknown decode eviction method {name!r}; valid methods: {', '.join(_METHODS)}")
    return _METHODS[name]
