"""The one registry of methods: user-facing names -> composed policies, with what each method can do asked of
the registry (``MethodInfo``), and each method's decode-time form beside it. Adding a method = its file and
one ``_register`` line (``decode=`` on that line gives its decode form)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_kvevict.policies.adakv import AdaKV
from vllm_kvevict.policies.base import EvictionPolicy, WrappingPolicy
from vllm_kvevict.policies.criticalkv import CriticalKV
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy
from vllm_kvevict.policies.decode.decode_scored import DecodeForm, DecodeStreamingLLM
from vllm_kvevict.policies.decode.decode_snapkv import DecodeSnapKV
from vllm_kvevict.policies.decode.decode_states import DecodeH2O, DecodeRoCo
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
#: kvzap's modes a decode cap cannot run (its count is known before the scores): threshold, pooled ranking.
_KVZAP_PREFILL_ONLY = ("threshold", "threshold_scope", "budget_scope", "head_unit")
#: The decode methods listed first, in the order ``--kv-decode-eviction`` always listed them (the docs quote
#: it); the others follow in registration order.
_DECODE_LISTED_FIRST = ("roco", "h2o", "streamingllm")

#: A decode form: a ``DecodeEvictionPolicy`` class (a method that keeps running state), or ``DecodeForm``
#: (the prefill scorer wrapped, for one that reads no queries).
DecodeBuilder = type[DecodeEvictionPolicy] | DecodeForm


@dataclass(frozen=True)
class MethodInfo:
    """One registered method: its user name, a one-line description, its parameters with defaults, and what
    it can do, as the datapath and the settings ask it (never by method name).

    needs_o_proj: it reads each layer's o_proj weight (``LayerKV.o_proj``), which the worker must collect.
    implies_decode_cap: its paper defines it at decode time, so the method alone caps every head while
        generating too (at its prefill budget).
    takes_echo: it judges by a bounded window of trailing queries, so the question echo's queries can join
        that window (``datapath/question_echo.py``): a part owns ``with_echo_queries`` (SnapKV and its
        subclasses, NaCl; Ada-KV and CriticalKV wrap such a part).
    reads_queries: it scores with the prompt's queries (``query_window`` > 0); one that reads none judges a
        prompt before its question has arrived, and its decode form wraps its prefill scorer.
    reads_query_statistics: it scores with running statistics of every prompt query (Expected Attention),
        which a caller evicting chunk by chunk carries across the chunks.
    pools_layers: it can share one budget among every layer of a request (KVzap's ``budget_scope``; the
        built policy's ``pools_layers``, ``kept_score_floor`` and ``forced_by_position`` then answer).
    learned: it scores with a learned scorer (``learned_scorer``), which the server must find or load.
    decode_form: it has a decode-time form of the same name (``build_decode_policy``).
    """

    name: str
    description: str
    params: dict[str, Any]
    needs_o_proj: bool = False
    implies_decode_cap: bool = False
    takes_echo: bool = False
    reads_queries: bool = False
    reads_query_statistics: bool = False
    pools_layers: bool = False
    learned: bool = False
    decode_form: bool = False


#: The ``MethodInfo`` capabilities a method has when any of its parts (classes) has them.
_PART_CAPABILITIES: dict[str, Callable[[type], bool]] = {
    "needs_o_proj": lambda part: getattr(part, "needs_o_proj", False),
    "takes_echo": lambda part: hasattr(part, "with_echo_queries"),
    # A wrapper's query window is its inner part's, which the parts hold too.
    "reads_queries": lambda part: (
        not issubclass(part, WrappingPolicy) and part.query_window is not EvictionPolicy.query_window
    ),
    "reads_query_statistics": lambda part: (
        part.reads_query_statistics is not EvictionPolicy.reads_query_statistics
    ),
    "learned": lambda part: hasattr(part, "learned_scorer"),
}


@dataclass(frozen=True)
class _Method:
    description: str
    parts: tuple[type, ...]
    compose: Callable[..., EvictionPolicy]
    implies_decode_cap: bool = False
    #: its decode-time form and that form's description, or None
    decode: tuple[DecodeBuilder, str] | None = None

    def info(self, name: str) -> MethodInfo:
        params = {key: value for part in self.parts for key, value in _params(part).items()}
        answered = {field: any(map(has, self.parts)) for field, has in _PART_CAPABILITIES.items()}
        # Only a lone part can pool layers: an allocation wrapper (Ada-KV) shares a budget per layer.
        pools = len(self.parts) == 1 and self.parts[0].pools_layers is not EvictionPolicy.pools_layers
        return MethodInfo(
            name, self.description, params, implies_decode_cap=self.implies_decode_cap, pools_layers=pools,
            decode_form=self.decode is not None, **answered,
        )  # fmt: skip


_METHODS: dict[str, _Method] = {}


def _register(
    name: str,
    description: str,
    *parts: type,
    implies_decode_cap: bool = False,
    decode: tuple[DecodeBuilder, str] | None = None,
    compose: Callable[..., EvictionPolicy] | None = None,
) -> None:
    """``parts``: the method's classes, innermost first; each later one wraps the one before as its ``inner``
    (``CriticalKV(AdaKV(SnapKV()))``) unless ``compose`` builds them, given one keyword dict per part holding
    that part's parameters. ``implies_decode_cap``: see ``MethodInfo``; ``decode``: its decode form (a
    ``DecodeEvictionPolicy`` class that keeps running state, or a ``DecodeForm`` around the prefill scorer)
    and that form's description."""
    _METHODS[name] = _Method(description, parts, compose or _nested(parts), implies_decode_cap, decode)


def _nested(parts: tuple[type, ...]) -> Callable[..., EvictionPolicy]:
    def compose(*params: dict[str, Any]) -> EvictionPolicy:
        policy = parts[0](**params[0])
        for part, own in zip(parts[1:], params[1:], strict=True):
            policy = part(policy, **own)
        return policy

    return compose


def _params(part: type) -> dict[str, Any]:
    return {
        f.name: f.default
        for f in dataclasses.fields(part)
        if f.name not in _WRAPPED_FIELDS and f.default is not dataclasses.MISSING
    }


# fmt: off
_register(
    "snapkv", "observation-window attention, pooled; keeps the window", SnapKV,
    decode=(DecodeSnapKV, "attention of the last window queries, pooled; keeps the window"),
)
_register("pyramidkv", "SnapKV scores, budgets shrinking from first to last layer", PyramidKV)
_register("ada-snapkv", "SnapKV scores, per-head budgets allocated across heads (Ada-KV)", SnapKV, AdaKV)
_register(
    "ada-pyramidkv", "PyramidKV layer budgets, per-head budgets allocated across heads (Ada-KV)",
    PyramidKV, AdaKV,
)
_register(
    "critical-snapkv",
    "SnapKV, half the budget by attention, the rest by attention x projected value norm (CriticalKV)",
    SnapKV, CriticalKV,
)
_register(
    "critical-ada-snapkv", "CriticalKV selection inside Ada-KV's per-head budgets", SnapKV, AdaKV, CriticalKV
)
_register(
    "streamingllm", "first tokens (attention sinks) plus the most recent ones", StreamingLLM,
    implies_decode_cap=True,
    decode=(DecodeStreamingLLM, "first entries (attention sinks) plus the most recent ones"),
)
_register(
    "h2o", "heavy hitters by attention accumulated over all prompt queries, plus recent tokens", H2O,
    implies_decode_cap=True, decode=(DecodeH2O, "heavy hitters by accumulated attention, plus recent"),
)
_register("nacl", "proxy-token (window) attention top-k plus seeded per-head random sampling by score", NaCl)
_register("keydiff", "keys least like their head's mean key (no queries), sinks and recent", KeyDiff)
_register("knorm", "keys with the smallest L2 norm (no queries), sinks and recent", KNorm)
_register(
    "expected-attention",
    "keys the future queries are expected to attend to (query mean/covariance, averaged RoPE) x value norm",
    ExpectedAttention,
)
_register(
    "ada-expected-attention",
    "Expected Attention scores, per-head budgets allocated across heads (Ada-KV; kvpress's leaderboard)",
    ExpectedAttention, AdaKV,
)
_register(
    "roco", "mean attention received, most volatile (high std) tokens kept, plus recent", RoCo,
    implies_decode_cap=True,
    decode=(DecodeRoCo, "mean attention of the queries that saw an entry, volatile ones kept, plus recent"),
)
_register(
    "kvzap", "a learned scorer's predicted KVzip scores (no queries), sinks and recent", KVzap,
    decode=(DecodeForm(KVzap, dropped=_KVZAP_PREFILL_ONLY), "the learned scorer's score of each held entry"),
)
_register(
    "ada-kvzap", "learned KVzip scores (kvzap), per-head budgets allocated across heads (Ada-KV)",
    KVzap, AdaKV,
    compose=lambda z, a: AdaKV(KVzap(**z).with_fixed_budget("ada-kvzap"), **a),
    decode=(DecodeForm(KVzap, True, _KVZAP_PREFILL_ONLY), "kvzap's scores, caps split across heads (Ada-KV)"),
)
# fmt: on


def available_methods() -> list[MethodInfo]:
    """Every registered method, in registration order."""
    return [method.info(name) for name, method in _METHODS.items()]


def method_names() -> list[str]:
    return list(_METHODS)


def _capability(name: str, capability: str) -> bool:
    """``MethodInfo.<capability>`` of the method registered as ``name``; False for an unknown name
    (validation names it)."""
    method = _METHODS.get(name) if isinstance(name, str) else None
    return method is not None and bool(getattr(method.info(name), capability))


def method_needs_o_proj(name: str) -> bool:
    """True when the method registered as ``name`` reads the o_proj weights (False for an unknown name)."""
    return _capability(name, "needs_o_proj")


def method_implies_decode_cap(name: str) -> bool:
    """True when the method registered as ``name`` alone implies a decode-time cap (``MethodInfo``)."""
    return _capability(name, "implies_decode_cap")


def method_takes_echo(name: str) -> bool:
    """True when the method registered as ``name`` takes the question echo (``MethodInfo.takes_echo``)."""
    return _capability(name, "takes_echo")


def method_info(name: str) -> MethodInfo | None:
    """What the method registered as ``name`` is and can do (``pools_layers``, ``learned``, ...), or None."""
    method = _METHODS.get(name) if isinstance(name, str) else None
    return None if method is None else method.info(name)


def methods_taking_echo() -> list[str]:
    """The registered methods that take the question echo, in registration order."""
    return [info.name for info in available_methods() if info.takes_echo]


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


def decode_methods() -> dict[str, tuple[DecodeBuilder, str]]:
    """Each decode-time form and its description, in the order ``--kv-decode-eviction`` lists them."""
    forms = {name: method.decode for name, method in _METHODS.items() if method.decode is not None}
    order = [*_DECODE_LISTED_FIRST, *(name for name in forms if name not in _DECODE_LISTED_FIRST)]
    return {name: forms[name] for name in order}


def decode_method_names() -> list[str]:
    return list(decode_methods())


def decode_method_description(name: str) -> str:
    return _decode_form(name)[1]


def decode_method_params(name: str) -> dict[str, Any]:
    """The parameters of decode method ``name`` with their defaults."""
    builder = _decode_form(name)[0]
    if isinstance(builder, DecodeForm):
        return builder.params()
    return {f.name: f.default for f in dataclasses.fields(builder)}


def build_decode_policy(name: str, **params: Any) -> DecodeEvictionPolicy:
    """The decode-time method registered as ``name`` with ``params`` overriding its defaults.

    Raises ValueError for an unknown name or parameter (listing the valid ones) or a bad value (naming it).
    """
    build: Callable[..., DecodeEvictionPolicy] = _decode_form(name)[0]
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


def _decode_form(name: str) -> tuple[DecodeBuilder, str]:
    forms = decode_methods()
    if name not in forms:
        raise ValueError(f"unknown decode eviction method {name!r}; valid methods: {', '.join(forms)}")
    return forms[name]
