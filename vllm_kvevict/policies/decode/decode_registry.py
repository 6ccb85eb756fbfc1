"""User-facing decode-time method names -> configured policies. A new method = its file + one line here."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_kvevict.policies.decode.decode_h2o import DecodeH2O
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy
from vllm_kvevict.policies.decode.decode_roco import DecodeRoCo
from vllm_kvevict.policies.decode.decode_snapkv import DecodeSnapKV
from vllm_kvevict.policies.decode.decode_streamingllm import DecodeStreamingLLM

_METHODS: dict[str, tuple[type[DecodeEvictionPolicy], str]] = {
    "roco": (DecodeRoCo, "mean attention of the queries that saw an entry, volatile ones kept, plus recent"),
    "h2o": (DecodeH2O, "heavy hitters by accumulated attention, plus recent"),
    "streamingllm": (DecodeStreamingLLM, "first entries (attention sinks) plus the most recent ones"),
    "snapkv": (DecodeSnapKV, "attention of the last window queries, pooled; keeps the window"),
}


def decode_method_names() -> list[str]:
    return list(_METHODS)


def decode_method_description(name: str) -> str:
    return _method(name)[1]


def decode_method_params(name: str) -> dict[str, Any]:
    """The parameters of method ``name`` with their defaults."""
    return {f.name: f.default for f in dataclasses.fields(_method(name)[0])}


def build_decode_policy(name: str, **params: Any) -> DecodeEvictionPolicy:
    """The decode-time method registered as ``name`` with ``params`` overriding its defaults.

    Raises ValueError for an unknown name or parameter (listing the valid ones) or a bad value (naming it).
    """
    cls = _method(name)[0]
    known = decode_method_params(name)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} for decode method {name!r}; "
            f"valid parameters: {', '.join(known) or '(none)'}"
        )
    policy = cls(**params)
    policy.name = name
    return policy


def _method(name: str) -> tuple[type[DecodeEvictionPolicy], str]:
    if name not in _METHODS:
        raise ValueError(f"unknown decode eviction method {name!r}; valid methods: {', '.join(_METHODS)}")
    return _METHODS[name]
