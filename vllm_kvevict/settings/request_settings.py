"""Per-request eviction settings: ``vllm_xargs`` → ``SamplingParams.extra_args`` → the request's plan.

The API server refuses a bad setting (``request_override.parse_override``, an HTTP 400 before scheduling).
The scheduler's manager (``evicting_kv_manager.py``) and each worker (``datapath/worker.py``) both see the
request's sampling parameters and resolve them with :class:`RequestSettings` built from the same server
config, block size and depth, once per distinct setting in each process: ``RequestSettings.plan`` is the one
pure function of (setting, prompt length, shared prefix) both sides call, so they agree without a message.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from vllm_kvevict.layout.accounting import RequestPlan, request_planner
from vllm_kvevict.layout.context_reuse import context_plan
from vllm_kvevict.layout.shared_prefix import private_plan
from vllm_kvevict.policies.base import EvictionPolicy
from vllm_kvevict.policies.between_chunks import trailing_floor
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.parsers import EvictionConfigError
from vllm_kvevict.settings.request_override import (
    CONTEXT_VALUES,
    NO_EVICTION,
    OVERRIDE_KEYS,
    PREFILL_KEY,
    RequestOverride,
    build_request_policy,
    decode_policy,
    method_params,
    parse_override,
)

#: read from here by datapath/ and the docs tests
__all__ = ["CONTEXT_VALUES", "OVERRIDE_KEYS", "PREFILL_KEY", "decode_policy"]

logger = logging.getLogger("vllm.kvevict")


def keep_whole(prompt_len: int, block_size: int, num_layers: int) -> RequestPlan:
    """The plan of a request that keeps its whole cache: nothing compacts, nothing is freed."""
    return RequestPlan(prompt_len, block_size, (prompt_len,) * num_layers, prompt_len, 0, False)


@dataclass(frozen=True)
class ResolvedSetting:
    """What one side needs for a request: its method, policy (None for "none") and plan per prompt length
    (whose ``decode_cap`` says whether the server's decode-time policy re-scores it); keeps_context: it asked
    ``kv_context: "keep"``, and ``identity`` then names everything its kept set depends on (the key of a
    kept context, with its tokens)."""

    method: str
    policy: EvictionPolicy | None
    plan_for: Callable[[int], RequestPlan]
    keeps_context: bool = False
    identity: str = ""
    question_echo: int | None = None  # None: the server's


def _setting_key(extra_args: Mapping[str, Any] | None) -> tuple[tuple[str, type, Any], ...] | None:
    """The per-request keys of ``extra_args`` with their types (True and 1 differ), or None when a value
    cannot be a cache key (such a value is refused anyway)."""
    key = tuple((k, type(v), v) for k, v in (extra_args or {}).items() if k in OVERRIDE_KEYS)
    try:
        hash(key)
    except TypeError:
        return None
    return key


class RequestSettings:
    """Resolves a request's ``extra_args`` to its setting; one instance per side (scheduler, worker), built
    from the same server config, block size and depth, hence the same answers on both.

    A value the API server would have refused (an engine driven from Python without the validator) is
    logged and falls back to the server's setting on both sides alike: the sides must agree, and the engine
    must not go down.
    """

    def __init__(self, server: EvictionConfig, block_size: int, num_layers: int) -> None:
        self.server = server
        self.block_size = block_size
        self.num_layers = num_layers
        self._parsed = lru_cache(maxsize=64)(self._parse)
        self._resolved = lru_cache(maxsize=64)(self._resolve)
        #: the server's own plan per prompt length
        self.plan_for = self.planner(server.budget, server.build_policy())

    def planner(
        self,
        budget: int | float,
        policy: EvictionPolicy,
        decode_budget: int | float | None = None,
        prefill: str | None = None,
    ) -> Callable[[int], RequestPlan]:
        """The plan per prompt length of ``budget`` and ``policy`` on this server: ``chunk_budget`` between
        chunks where the prompt is evicted chunk by chunk (``prefill``, None: the server's mode; FastKVzip's
        rule instead with ``trailing_window`` > 0, holding at least what the between-chunks selection always
        keeps) and the server's decode-time cap (``decode_budget`` overriding its cap)."""
        server = self.server
        chunked = server.chunked if prefill is None else prefill == "chunked"
        chunks: dict[str, Any] = {
            "chunk_budget": server.chunk_budget if chunked else None,
            "chunk_stride": server.chunk_stride or 0,
        }
        if server.trailing_window:
            floor = trailing_floor(policy, server.between_rule)
            chunks.update(trailing_window=server.trailing_window, trailing_floor=floor)
        args: tuple[Any, ...] = (budget, self.block_size, policy, self.num_layers)
        if server.decode is not None:
            cap = server.decode.budget if decode_budget is None else decode_budget
            args += (cap, server.decode.interval, decode_policy(server.decode).min_cap)
        return request_planner(*args, **chunks)

    def plan(self, setting: ResolvedSetting | None, prompt_len: int, shared: int = 0) -> RequestPlan:
        """The plan of a request's private part, as both sides derive it: its setting's (None: the server's)
        after the ``shared`` prompt tokens it found in the prefix cache (``shared_prefix.private_plan``), or
        of its kept context (``context_reuse.context_plan``)."""
        if setting is not None and setting.keeps_context:
            return context_plan(setting.plan_for, prompt_len, shared, self.block_size, self.num_layers)
        plan_for = self.plan_for if setting is None else setting.plan_for
        return private_plan(plan_for, prompt_len, shared, self.server.min_freed_share)

    def override(self, extra_args: Mapping[str, Any] | None) -> RequestOverride | None:
        """The request's override, or None for the server's setting (also when the value is invalid)."""
        key = _setting_key(extra_args)
        try:
            return parse_override(extra_args, self.server) if key is None else self._parsed(key)
        except EvictionConfigError as exc:
            logger.warning("kv-eviction: %s; the request uses the server's setting", exc)
            return None

    def _parse(self, key: tuple[tuple[str, type, Any], ...]) -> RequestOverride | None:
        return parse_override({name: value for name, _, value in key}, self.server)

    def resolve(self, extra_args: Mapping[str, Any] | None) -> ResolvedSetting | None:
        """The request's setting, or None when it uses the server's own (resolved once per distinct
        setting)."""
        override = self.override(extra_args)
        return None if override is None else self._resolved(override)

    def _resolve(self, override: RequestOverride) -> ResolvedSetting:
        if override.method == NO_EVICTION:
            bs, layers = self.block_size, self.num_layers
            return ResolvedSetting(NO_EVICTION, None, lambda prompt_len: keep_whole(prompt_len, bs, layers))
        policy = build_request_policy(override.method, self.server)
        assert override.budget is not None
        plan_for = self.planner(override.budget, policy, override.decode_budget, override.prefill)
        identity = ""
        if override.context:
            policy = policy.kept_context_form(self.block_size)
            assert policy is not None  # parse_context refused the others
            params = method_params(override.method, self.server)
            identity = json.dumps(
                {"method": override.method, "budget": override.budget, "params": params}, sort_keys=True
            )
        return ResolvedSetting(
            override.method, policy, plan_for, override.context, identity, override.question_echo
        )
