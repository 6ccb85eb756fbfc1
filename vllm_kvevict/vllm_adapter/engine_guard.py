"""Guard rails for engines built from Python (``LLM(..., additional_config={"kv_eviction": ...})``).

``vllm serve`` applies them in ``EngineArgs.from_cli_args`` (``vllm_patches.install_cli_hooks``);
``LLM()`` and ``AsyncLLM.from_engine_args`` never call that, they go straight to
``EngineArgs.create_engine_config``. The wrapper there calls ``guard_engine_args`` first, so the Python path
gets the same validation, the same logged setting changes and the same refusals: the rails'
``GuardRailError``, a ``ValueError``, where the CLI exits.
"""

from __future__ import annotations

from typing import Any

from vllm_kvevict.settings.config import (
    ADDITIONAL_CONFIG_KEY,
    EvictionConfigError,
    eviction_config_from_additional,
)
from vllm_kvevict.vllm_adapter.cli_args import add_request_validator, apply_guard_rails

#: Set on EngineArgs once the rails ran (the CLI path runs them in from_cli_args already).
GUARDED_MARK = "_kvevict_guarded"


def guard_engine_args(engine_args: Any) -> None:
    """Validate ``additional_config["kv_eviction"]`` and apply the start-up guard rails to ``engine_args``.

    No-op when eviction is off or the rails already ran. Raises ValueError naming the bad value
    (``GuardRailError`` for a refusal of the rails)."""
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
    apply_guard_rails(engine_args, config)
    engine_args.additional_config = {**additional, ADDITIONAL_CONFIG_KEY: config.to_dict()}
    # Per-request vllm_xargs (SamplingParams.extra_args) are checked like the API server checks them.
    add_request_validator(engine_args, config)
    mark_guarded(engine_args)


def mark_guarded(engine_args: Any) -> None:
    """Record that the rails ran on ``engine_args`` (the CLI path calls this after from_cli_args)."""
    setattr(engine_args, GUARDED_MARK, True)
