"""Eviction set up on a vLLM engine's arguments, on both paths that build an engine: the config written into
``additional_config["kv_eviction"]``, the start-up guard rails applied (``engine_requirements.py``) and the
per-request check of ``vllm_xargs`` turned on (``request_validation.py``).

``vllm serve`` does it in ``EngineArgs.from_cli_args`` (``apply_eviction_to_engine_args``, from the flags of
``eviction_flags.py``; ``vllm_patches.install_cli_hooks``). ``LLM()`` and ``AsyncLLM.from_engine_args`` never
call that, they go straight to ``EngineArgs.create_engine_config``; the wrapper there calls
``apply_eviction_from_additional_config`` first, so the Python path gets the same validation, the same logged
setting changes and the same refusals: the rails' ``UnsupportedEngineSetting``, a ``ValueError``, where the
CLI exits.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_kvevict.settings.additional_config import (
    ADDITIONAL_CONFIG_KEY,
    eviction_config_from_additional,
    with_eviction,
)
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.parsers import EvictionConfigError
from vllm_kvevict.vllm_adapter.engine_requirements import fit_engine_to_eviction
from vllm_kvevict.vllm_adapter.eviction_flags import eviction_config_from_args
from vllm_kvevict.vllm_adapter.metrics_multiprocess import ensure_multiprocess_collection
from vllm_kvevict.vllm_adapter.request_validation import (
    MIDDLEWARE_PATH,
    VALIDATOR_FQCN,
    publish_server_config,
)

#: the one line every refusal of ``vllm serve`` starts with (the form of argparse's own errors).
CLI_ERROR_PREFIX = "vllm serve: error: "
#: Set on EngineArgs once the rails ran (the CLI path runs them in from_cli_args already).
GUARDED_MARK = "_kvevict_guarded"


def apply_eviction_from_additional_config(engine_args: Any) -> None:
    """Validate ``additional_config["kv_eviction"]`` and apply the start-up guard rails to ``engine_args``.

    No-op when eviction is off or the rails already ran. Raises ValueError naming the bad value
    (``UnsupportedEngineSetting`` for a refusal of the rails)."""
    if getattr(engine_args, GUARDED_MARK, False):
        return
    additional = engine_args.additional_config or {}
    if ADDITIONAL_CONFIG_KEY not in additional:
        return
    try:
        config = eviction_config_from_additional(additional)
    except EvictionConfigError as exc:
        raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]: {exc}") from None
    if config is None:
        return
    fit_engine_to_eviction(engine_args, config)
    engine_args.additional_config = with_eviction(additional, config)
    # Per-request vllm_xargs (SamplingParams.extra_args) are checked like the API server checks them.
    add_request_validator(engine_args, config)
    mark_guarded(engine_args)


def mark_guarded(engine_args: Any) -> None:
    """Record that the rails ran on ``engine_args`` (the CLI path calls this after from_cli_args)."""
    setattr(engine_args, GUARDED_MARK, True)


def apply_eviction_to_engine_args(args: argparse.Namespace, engine_args: Any) -> None:
    """Put the eviction config into ``engine_args.additional_config`` and apply the start-up guard rails,
    each stated in one log line. The ``vllm serve`` path (``vllm_patches.install_cli_hooks``): a bad setting
    or a refusal of the rails exits with one line, the only place either becomes an exit."""
    try:
        config = eviction_config_from_args(args, engine_args.additional_config)
        if config is None:
            return
        engine_args.additional_config = with_eviction(engine_args.additional_config, config)
        fit_engine_to_eviction(engine_args, config)
    except EvictionConfigError as exc:  # UnsupportedEngineSetting included
        raise SystemExit(f"{CLI_ERROR_PREFIX}{exc}") from None
    enable_request_validation(args, engine_args, config)
    # Before EngineCore/workers start: their vllm_kvevict_* metrics reach /metrics only this way.
    ensure_multiprocess_collection()


def enable_request_validation(args: argparse.Namespace, engine_args: Any, config: EvictionConfig) -> None:
    """Per-request ``vllm_xargs`` overrides are checked by the API server (HTTP 400 before scheduling):
    an ASGI middleware (``--middleware``, read from ``args`` when the app is built) and vLLM's
    logits-processor ``validate_params`` hook (``request_validation.py``)."""
    add_request_validator(engine_args, config)
    middleware = list(getattr(args, "middleware", None) or [])
    if MIDDLEWARE_PATH not in middleware:
        args.middleware = [*middleware, MIDDLEWARE_PATH]


def add_request_validator(engine_args: Any, config: EvictionConfig) -> None:
    """The engine side of the per-request check (also for ``LLM()``): the server's setting published for
    ``request_validation.py`` and its logits processor, whose ``validate_params`` refuses bad extra_args."""
    publish_server_config(config)
    processors = list(engine_args.logits_processors or [])
    if VALIDATOR_FQCN not in processors:
        engine_args.logits_processors = [*processors, VALIDATOR_FQCN]
