"""Wrappers that give ``vllm serve`` the eviction flags and every engine the guard rails.

vLLM 0.32.0 has no registry for engine CLI flags, so the plugin wraps three ``EngineArgs`` class attributes:
- ``EngineArgs.add_cli_args`` (staticmethod): ``AsyncEngineArgs.add_cli_args`` calls it by name after loading
  the general plugins, so our argument group shows up in ``vllm serve --help``.
- ``EngineArgs.from_cli_args`` (classmethod, inherited by ``AsyncEngineArgs``): it keeps only dataclass
  fields, so our flags would be dropped; the wrapper moves them into ``additional_config["kv_eviction"]``
  and applies the start-up guard rails (also for the ``--additional-config`` fallback).
- ``EngineArgs.create_engine_config``: ``LLM(...)`` and ``AsyncLLM.from_engine_args`` build their config here
  without from_cli_args, so the wrapper applies the same rails first (engine_guard.py; a ValueError there).
Checked against vLLM 0.32.0 (vllm/engine/arg_utils.py, vllm/entrypoints/llm.py).
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm.engine.arg_utils import EngineArgs

from vllm_kvevict.vllm_adapter.cli_args import add_eviction_args, apply_eviction_to_engine_args
from vllm_kvevict.vllm_adapter.engine_guard import guard_engine_args, mark_guarded

_MARK = "__kvevict_wrapped__"


def install() -> None:
    """Wrap the three EngineArgs methods once per process."""
    if getattr(EngineArgs.add_cli_args, _MARK, False):
        return
    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.from_cli_args.__func__
    original_create = EngineArgs.create_engine_config

    def add_cli_args(parser: Any) -> Any:
        parser = original_add(parser)
        add_eviction_args(parser)
        return parser

    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        engine_args = original_from(cls, args)
        apply_eviction_to_engine_args(args, engine_args)
        mark_guarded(engine_args)
        return engine_args

    def create_engine_config(self: EngineArgs, *args: Any, **kwargs: Any) -> Any:
        guard_engine_args(self)
        return original_create(self, *args, **kwargs)

    setattr(add_cli_args, _MARK, True)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config
