"""The ``--kv-eviction``, ``--kv-budget`` and ``--kv-eviction-config`` flags of ``vllm serve``.

The flags end up in ``additional_config["kv_eviction"]``, the one piece of configuration vLLM hands to every
process. ``--additional-config.kv_eviction.*`` (or ``--additional-config '{"kv_eviction": ...}'``) stays the
documented fallback and goes through the same validation and start-up guard rails.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from vllm.logger import init_logger

from vllm_kvevict.policies.presets import Preset
from vllm_kvevict.vllm_adapter.config import (
    ADDITIONAL_CONFIG_KEY,
    EvictionConfig,
    EvictionConfigError,
    eviction_config_from_additional,
    method_names,
    parse_budget,
    parse_params_or_preset,
)
from vllm_kvevict.vllm_adapter.metrics_multiprocess import ensure_multiprocess_collection
from vllm_kvevict.vllm_adapter.request_validation import (
    MIDDLEWARE_PATH,
    VALIDATOR_FQCN,
    publish_server_config,
)

logger = init_logger("vllm.kvevict")

FLAG_GROUP_TITLE = "KVEviction"


def _budget_type(text: str) -> int | float:
    try:
        return parse_budget(text)
    except EvictionConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("kv_eviction.budget", "--kv-budget")) from exc


def _params_type(text: str) -> dict[str, Any] | Preset:
    try:
        return parse_params_or_preset(text)
    except EvictionConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_eviction_args(parser: argparse.ArgumentParser) -> None:
    """Add the eviction flags to a ``vllm serve`` parser (idempotent)."""
    if any("--kv-eviction" in action.option_strings for action in parser._actions):
        return
    group = parser.add_argument_group(
        title=FLAG_GROUP_TITLE,
        description="vllm-kvevict: evict KV-cache entries per attention head after prefill and free "
        "paged blocks. "
        "Off unless --kv-eviction is given (or additional_config.kv_eviction is set).",
    )
    names = method_names()
    group.add_argument(
        "--kv-eviction",
        dest="kv_eviction",
        metavar="METHOD",
        choices=names,
        default=None,
        help=f"Eviction method, one of: {', '.join(names)}. `vllm-kvevict methods` describes them.",
    )
    group.add_argument(
        "--kv-budget",
        dest="kv_budget",
        metavar="BUDGET",
        type=_budget_type,
        default=None,
        help="Kept KV per request: an integer = average kept tokens per KV head (e.g. 1024), or a float in "
        "(0, 1) = kept fraction of the prompt (e.g. 0.25). Required with --kv-eviction.",
    )
    group.add_argument(
        "--kv-eviction-config",
        dest="kv_eviction_config",
        metavar="JSON|FILE",
        type=_params_type,
        default=None,
        help='Method parameters as a JSON object, e.g. \'{"window": 32, "kernel": 7, "alpha": 0.2}\', or a '
        "preset file such as configs/ada-snapkv.yaml (its method is used unless --kv-eviction names it).",
    )


def eviction_config_from_args(args: argparse.Namespace, additional_config: dict[str, Any] | None) -> (
    EvictionConfig | None
):
    """Merge the flags over ``additional_config["kv_eviction"]``; flags win. Raises EvictionConfigError."""
    method = getattr(args, "kv_eviction", None)
    budget = getattr(args, "kv_budget", None)
    params = getattr(args, "kv_eviction_config", None)
    existing = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if isinstance(params, Preset):
        if method is not None and method != params.method:
            raise EvictionConfigError(
                f"--kv-eviction {method} contradicts the preset's method {params.method!r} "
                "(--kv-eviction-config); drop --kv-eviction or use a preset of that method"
            )
        method, params = params.method, params.params
    if method is None and existing is None:
        if budget is not None or params is not None:
            raise EvictionConfigError(
                "--kv-budget/--kv-eviction-config need --kv-eviction METHOD; valid methods: "
                + ", ".join(method_names())
            )
        return None
    merged: dict[str, Any] = dict(existing) if isinstance(existing, dict) else {}
    if method is not None:
        merged["method"] = method
    if budget is not None:
        merged["budget"] = budget
    if params is not None:
        merged["params"] = {**(merged.get("params") or {}), **params}
    if method is not None and "budget" not in merged:
        raise EvictionConfigError(
            f"--kv-eviction {method} needs --kv-budget: an integer (kept tokens per KV head, e.g. 1024) "
            "or a float in (0, 1) (kept fraction of the prompt)"
        )
    return eviction_config_from_additional({ADDITIONAL_CONFIG_KEY: merged})


def apply_eviction_to_engine_args(args: argparse.Namespace, engine_args: Any) -> None:
    """Put the eviction config into ``engine_args.additional_config`` and apply the start-up guard rails,
    each stated in one log line. Exits with one clear line on a bad setting."""
    try:
        config = eviction_config_from_args(args, engine_args.additional_config)
    except EvictionConfigError as exc:
        raise SystemExit(f"vllm serve: error: {exc}") from None
    if config is None:
        return
    additional = dict(engine_args.additional_config or {})
    additional[ADDITIONAL_CONFIG_KEY] = config.to_dict()
    engine_args.additional_config = additional
    apply_guard_rails(engine_args, config)
    enable_request_validation(args, engine_args, config)
    # Before EngineCore/workers start: their vllm_kvevict_* metrics reach /metrics only this way.
    ensure_multiprocess_collection()


def enable_request_validation(args: argparse.Namespace, engine_args: Any, config: EvictionConfig) -> None:
    """Per-request ``vllm_xargs`` overrides are checked by the API server (HTTP 400 before scheduling):
    an ASGI middleware (``--middleware``, read from ``args`` when the app is built) and vLLM's
    logits-processor ``validate_params`` hook (``request_validation.py``)."""
    publish_server_config(config)
    processors = list(engine_args.logits_processors or [])
    if VALIDATOR_FQCN not in processors:
        engine_args.logits_processors = [*processors, VALIDATOR_FQCN]
    middleware = list(getattr(args, "middleware", None) or [])
    if MIDDLEWARE_PATH not in middleware:
        args.middleware = [*middleware, MIDDLEWARE_PATH]


def apply_guard_rails(engine_args: Any, config: EvictionConfig) -> None:
    """Settings eviction needs; every change is logged, none is silent."""
    logger.info("kv-eviction: %s", config.describe())
    if (getattr(engine_args, "pipeline_parallel_size", 1) or 1) > 1:
        raise SystemExit(
            f"vllm serve: error: --pipeline-parallel-size {engine_args.pipeline_parallel_size} is not "
            "supported with --kv-eviction (layers are indexed globally while a pipeline stage holds a slice "
            "of them); use --tensor-parallel-size instead"
        )
    if getattr(engine_args, "speculative_config", None):
        raise SystemExit(
            "vllm serve: error: --speculative-config is not supported with --kv-eviction (never tested, and "
            "vLLM refuses the per-request vllm_xargs validator, a logits processor, with speculative "
            "decoding); drop one of them"
        )
    if engine_args.enable_prefix_caching is not False:
        logger.info("kv-eviction: prefix caching turned off (compressed blocks are not reusable prefixes)")
        engine_args.enable_prefix_caching = False
    if engine_args.enable_chunked_prefill is not False:
        logger.info(
            "kv-eviction: chunked prefill turned off (scoring needs the whole prompt in one step); "
            "max_num_batched_tokens must be >= max_model_len"
        )
        engine_args.enable_chunked_prefill = False
    if not engine_args.enforce_eager:
        logger.info(
            "kv-eviction: enforce_eager on (eviction runs per-step Python in the attention backend, which "
            "captured graphs and compiled regions must not freeze)"
        )
        engine_args.enforce_eager = True
    select_cuda_backend(engine_args)
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0":
        logger.info("kv-eviction: VLLM_USE_V2_MODEL_RUNNER=0 (eviction hooks the V1 model runner)")
        # Set before the EngineCore and workers are spawned, so every child process inherits it.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def select_cuda_backend(engine_args: Any, is_cuda: bool | None = None) -> None:
    """On CUDA, eviction runs in the evicting FlashAttention backend, registered as ``CUSTOM``.

    On CPU the plugin overrides ``CPU_ATTN`` itself (vLLM ignores --attention-backend there)."""
    if is_cuda is None:
        from vllm.platforms import current_platform

        is_cuda = current_platform.is_cuda()
    if not is_cuda:
        return
    chosen = engine_args.attention_backend
    if chosen is not None and str(getattr(chosen, "name", chosen)).upper() != "CUSTOM":
        raise SystemExit(
            f"vllm serve: error: --attention-backend {getattr(chosen, 'name', chosen)} cannot evict; with "
            "--kv-eviction leave it unset or use CUSTOM (the evicting FlashAttention backend)"
        )
    if chosen is None:
        logger.info("kv-eviction: attention backend CUSTOM (the evicting FlashAttention backend)")
        engine_args.attention_backend = "CUSTOM"
