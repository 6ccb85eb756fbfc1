"""User-facing method names -> composed policies. Adding a method = its file + one ``_register`` line."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_kvevict.policies.adakv import AdaKV
from vllm_kvevict.policies.base import EvictionPolicy
from vllm_kvevict.policies.criticalkv import CriticalKV
from vllm_kvevict.policies.expected_attention import ExpectedAttention
from vllm_kvevict.policies.h2o import H2O
from vllm_kvevict.policies.keydiff import KeyDiff
from vllm_kvevict.policies.knorm import KNorm
from vllm_kvevict.policies.kvzap import KVzap
from vllm_kvevict.policies.nacl import NaCl
from vllm_kvevict.policies.pyramidkv import PyramidKV
from vllm_kvevict.policies.roco import RoCo
from vllm_kvevict.policies.snapkv import SnapKV
from vllm_kvevict.policies.streamingllm import StreamingLLM

#: Dataclass fields that are no user parameter: a wrapped policy, and what a kept context sets
#: (``EvictionPolicy.kept_context_form``).
_WRAPPED_FIELDS = frozenset({"inner", "head_unit"})


@dataclass(frozen=True)
class MethodInfo:
    """One registered method: its user name, a one-line description and its parameters with defaults.

    needs_o_proj: it reads each layer's o_proj weight (``LayerKV.o_proj``), which the worker must collect.
    implies_decode_cap: its paper defines it at decode time, so the method alone caps every head while
        generating too (at its prefill budget).
    takes_echo: it judges by a bounded window of trailing queries, so the question echo's queries can join
        that window (``datapath/question_echo.py``): a part owns ``with_echo_queries`` (SnapKV and its
        subclasses, NaCl; Ada-KV and CriticalKV wrap such a part).
    """

    name: str
    description: str
    params: dict[str, Any]
    needs_o_proj: bool = False
    implies_decode_cap: bool = False
    takes_echo: bool = False


@dataclass(frozen=True)
class _Method:
    description: str
    parts: tuple[type, ...]
    compose: Callable[..., EvictionPolicy]
    implies_decode_cap: bool = False

    @property
    def needs_o_proj(self) -> bool:
        return any(getattr(part, "needs_o_proj", False) for part in self.parts)

    @property
    def takes_echo(self) -> bool:
        return any(hasattr(part, "with_echo_queries") for part in self.parts)


_METHODS: dict[str, _Method] = {}


def _register(
    name: str,
    description: str,
    compose: Callable[..., EvictionPolicy],
    *parts: type,
    implies_decode_cap: bool = False,
) -> None:
    """``compose`` gets one keyword dict per part, in order, holding that part's parameters; a single
    class may be given as ``compose`` for a one-part method. ``implies_decode_cap``: see ``MethodInfo``."""
    if isinstance(compose, type):
        single = compose
        compose = lambda params: single(**params)  # noqa: E731
    _METHODS[name] = _Method(description, parts, compose, implies_decode_cap)


def _params(part: type) -> dict[str, Any]:
    return {
        f.name: f.default
        for f in dataclasses.fields(part)
        if f.name not in _WRAPPED_FIELDS and f.default is not dataclasses.MISSING
    }


_register("snapkv", "observation-window attention, pooled; keeps the window", SnapKV, SnapKV)
_register(
    "pyramidkv",
    "SnapKV scores, budgets shrinking from first to last layer",
    lambda p: PyramidKV(**p),
    PyramidKV,
)
_register(
    "ada-snapkv",
    "SnapKV scores, per-head budgets allocated across heads (Ada-KV)",
    lambda s, a: AdaKV(SnapKV(**s), **a),
    SnapKV,
    AdaKV,
)
_register(
    "ada-pyramidkv",
    "PyramidKV layer budgets, per-head budgets allocated across heads (Ada-KV)",
    lambda p, a: AdaKV(PyramidKV(**p), **a),
    PyramidKV,
    AdaKV,
)
_register(
    "critical-snapkv",
    "SnapKV, half the budget by attention, the rest by attention x projected value norm (CriticalKV)",
    lambda s, c: CriticalKV(SnapKV(**s), **c),
    SnapKV,
    CriticalKV,
)
_register(
    "critical-ada-snapkv",
    "CriticalKV selection inside Ada-KV's per-head budgets",
    lambda s, a, c: CriticalKV(AdaKV(SnapKV(**s), **a), **c),
    SnapKV,
    AdaKV,
    CriticalKV,
)
_register(
    "streamingllm",
    "first tokens (attention sinks) plus the most recent ones",
    lambda s: StreamingLLM(**s),
    StreamingLLM,
    implies_decode_cap=True,
)

_register(
    "h2o",
    "heavy hitters by attention accumulated over all prompt queries, plus recent tokens",
    H2O,
    H2O,
    implies_decode_cap=True,
)
_register(
    "nacl", "proxy-token (window) attention top-k plus seeded per-head random sampling by score", NaCl, NaCl
)
_register("keydiff", "keys least like their head's mean key (no queries), sinks and recent", KeyDiff, KeyDiff)
_register("knorm", "keys with the smallest L2 norm (no queries), sinks and recent", KNorm, KNorm)
_register(
    "expected-attention",
    "keys the future queries are expected to attend to (query mean/covariance, averaged RoPE) x value norm",
    ExpectedAttention,
    ExpectedAttention,
)
_register(
    "ada-expected-attention",
    "Expected Attention scores, per-head budgets allocated across heads (Ada-KV; kvpress's leaderboard)",
    lambda e, a: AdaKV(ExpectedAttention(**e), **a),
    ExpectedAttention,
    AdaKV,
)
_register(
    "roco",
    "mean attention received, most volatile (high std) tokens kept, plus recent",
    RoCo,
    RoCo,
    implies_decode_cap=True,
)
_register("kvzap", "a learned scorer's predicted KVzip scores (no queries), sinks and recent", KVzap, KVzap)
_register(
    "ada-kvzap",
    "learned KVzip scores (kvzap), per-head budgets allocated across heads (Ada-KV)",
    lambda z, a: AdaKV(KVzap(**z).with_fixed_budget("ada-kvzap"), **a),
    KVzap,
    AdaKV,
)


def available_methods() -> list[MethodInfo]:
    """Every registered method, in registration order."""
    infos = []
    for name, method in _METHODS.items():
        params: dict[str, Any] = {}
        for part in method.parts:
            params.update(_params(part))
        infos.append(
            MethodInfo(
                name,
                method.description,
                params,
                method.needs_o_proj,
                method.implies_decode_cap,
                method.takes_echo,
            )
        )
    return infos


def method_names() -> list[str]:
    return list(_METHODS)


def method_needs_o_proj(name: str) -> bool:
    """True when the method registered as ``name`` reads the o_proj weights (False for an unknown name)."""
    method = _METHODS.get(name) if isinstance(name, str) else None
    return method is not None and method.needs_o_proj


def method_implies_decode_cap(name: str) -> bool:
    """True when the method registered as ``name`` alone implies a decode-time cap (False for an unknown
    name: validation names it)."""
    method = _METHODS.get(name) if isinstance(name, str) else None
    return method is not None and method.implies_decode_cap


def method_takes_echo(name: str) -> bool:
    """True when the method registered as ``name`` takes the question echo (``MethodInfo.takes_echo``;
    False for an unknown name: validation names it)."""
    method = _METHODS.get(name) if isinstance(name, str) else None
    return method is not None and method.takes_echo


def methods_taking_echo() -> list[str]:
    """The registered methods that take the question echo, in registration order."""
    return [name for name, method in _METHODS.items() if method.takes_echo]


def build_policy(name: str, **params: Any) -> EvictionPolicy:
    """The policy registered as ``name`` with ``params`` overriding its defaults.

    Raises ValueError for an unknown name (listing the valid ones), an unknown parameter (listing the
    method's parameters) or a bad parameter value (naming it and what is valid).
    """
    method = _METHODS.get(name)
    if method is None:
        raise ValueError(f"unknown eviction method {name!r}; valid methods: {', '.join(_METHODS)}")
    per_part = [_params(part) for part in method.parts]
    known = {key for part in per_part for key in part}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} for method {name!r}; "
            f"valid parameters: {', '.join(sorted(known)) or '(none)'}"
        )
    kwargs = [{key: params[key] for key in part if key in params} for part in per_part]
    policy = method.compose(*kwargs)
    policy.name = name
    return policy
