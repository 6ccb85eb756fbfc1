"""The ``--kv-eviction``, ``--kv-budget`` and ``--kv-eviction-config`` flags of ``vllm serve``.

The flags end up in ``additional_config["kv_eviction"]``, the one piece of configuration vLLM hands to every
process. ``--additional-config.kv_eviction.*`` (or ``--additional-config '{"kv_eviction": ...}'``) stays the
documented fallback and goes through the same validation and start-up guard rails.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kvevict.policies.between_chunks import BETWEEN_KINDS, BETWEEN_SCORERS
from vllm_kvevict.policies.decode.decode_registry import decode_method_names
from vllm_kvevict.policies.presets import Preset
from vllm_kvevict.policies.registry import available_methods
from vllm_kvevict.settings.config import (
    ADDITIONAL_CONFIG_KEY,
    DECODE_ALLOCATIONS,
    NO_DECODE,
    EvictionConfig,
    EvictionConfigError,
    GuardRailError,
    budget_rule,
    eviction_config_from_additional,
    implied_decode,
    method_names,
    parse_budget,
    parse_params_json,
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


#: the one line every refusal of ``vllm serve`` starts with (the form of argparse's own errors).
CLI_ERROR_PREFIX = "vllm serve: error: "


def _budget_type(flag: str) -> Callable[[str], int | float]:
    """The argparse type of a budget flag: ``config.parse_budget`` naming ``flag``."""

    def parse(text: str) -> int | float:
        try:
            return parse_budget(text, flag)
        except EvictionConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse


def _interval_type(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"--kv-decode-interval={text!r} is not valid; use an integer >= 1 (generated tokens between "
            "re-scores, rounded up to whole blocks)"
        )
    return value


def _json_type(text: str) -> dict[str, Any]:
    try:
        return parse_params_json(text)
    except EvictionConfigError as exc:
        message = str(exc).replace("--kv-eviction-config", "--kv-decode-config")
        raise argparse.ArgumentTypeError(message) from exc


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
        description="vllm-kvevict: evict KV-cache entries per attention head after prefill (and, with a "
        "decode-time cap, while generating) and free paged blocks. "
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
        type=_budget_type("--kv-budget"),
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
        "preset file such as configs/ada-snapkv.yaml (its method is used unless --kv-eviction names it). "
        'The prompt schedule goes here too: "prefill" (whole|chunked), "chunk_budget" or "trailing_window", '
        '"between" '
        f'({"|".join(BETWEEN_KINDS)}, how a prompt is judged between chunks) and "between_scorer" '
        f"({'|'.join(BETWEEN_SCORERS)}, blend's second score).",
    )
    decode_names = [*decode_method_names(), NO_DECODE]
    decode_time = [info.name for info in available_methods() if info.implies_decode_cap]
    group.add_argument(
        "--kv-decode-eviction",
        dest="kv_decode_eviction",
        metavar="METHOD",
        choices=decode_names,
        default=None,
        help=f"Decode-time cap: re-score what each KV head holds while generating and evict down to "
        f"--kv-decode-budget, one of: {', '.join(decode_names)}. With --kv-eviction "
        f"{'/'.join(decode_time)} alone the cap is implied (the same method, cap = --kv-budget); "
        "'none' turns it off.",
    )
    group.add_argument(
        "--kv-decode-budget",
        dest="kv_decode_budget",
        metavar="CAP",
        type=_budget_type("--kv-decode-budget"),
        default=None,
        help="Decode-time cap: an integer = entries kept per KV head while generating (e.g. 2048), or a "
        "float in (0, 1) = a fraction of the prompt. Required with --kv-decode-eviction.",
    )
    group.add_argument(
        "--kv-decode-interval",
        dest="kv_decode_interval",
        metavar="TOKENS",
        type=_interval_type,
        default=None,
        help="Generated tokens between decode-time re-scores (default: one block; rounded up to whole "
        "blocks). A head holds at most cap + max(interval, 2 blocks) entries.",
    )
    group.add_argument(
        "--kv-decode-config",
        dest="kv_decode_config",
        metavar="JSON",
        type=_json_type,
        default=None,
        help='Decode method parameters as a JSON object, e.g. \'{"window": 32, "std_ratio": 0.5}\'.',
    )
    group.add_argument(
        "--kv-decode-allocation",
        dest="kv_decode_allocation",
        choices=DECODE_ALLOCATIONS,
        default=None,
        help="How a layer's decode cap is split across KV heads at each re-score: uniform (default, every "
        "head at the cap) or ada (heads x cap per layer, split by score as Ada-KV does).",
    )


def eviction_config_from_args(
    args: argparse.Namespace, additional_config: dict[str, Any] | None
) -> EvictionConfig | None:
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
    decode_given = any(
        getattr(args, name, None) is not None
        for name in (
            "kv_decode_eviction",
            "kv_decode_budget",
            "kv_decode_interval",
            "kv_decode_config",
            "kv_decode_allocation",
        )
    )
    if method is None and existing is None:
        if decode_given:
            raise EvictionConfigError(
                "--kv-decode-* need --kv-eviction METHOD --kv-budget N (the prefill setting; a budget at "
                "least the prompt keeps the prompt whole); valid methods: " + ", ".join(method_names())
            )
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
        raise EvictionConfigError(f"--kv-eviction {method} needs --kv-budget (e.g. 1024): {budget_rule()}")
    existing_decode = merged.get("decode")
    if existing_decode is None and "method" in merged and "budget" in merged:
        # --kv-eviction roco --kv-budget N --kv-decode-interval 64 tunes the cap roco implies.
        implied = implied_decode(merged["method"], merged["budget"], merged.get("params") or {})
        existing_decode = implied.to_dict() if implied is not None else None
    decode = decode_from_args(args, existing_decode)
    if decode is not None:
        merged["decode"] = decode
    return eviction_config_from_additional({ADDITIONAL_CONFIG_KEY: merged})


def decode_from_args(args: argparse.Namespace, existing: Any) -> dict[str, Any] | None:
    """The ``decode`` entry from the ``--kv-decode-*`` flags over an existing one (None: no flag given)."""
    flags = {
        "method": getattr(args, "kv_decode_eviction", None),
        "budget": getattr(args, "kv_decode_budget", None),
        "interval": getattr(args, "kv_decode_interval", None),
        "params": getattr(args, "kv_decode_config", None),
        "allocation": getattr(args, "kv_decode_allocation", None),
    }
    given = {key: value for key, value in flags.items() if value is not None}
    if not given:
        return None
    decode: dict[str, Any] = dict(existing) if isinstance(existing, dict) else {}
    decode.update(given)
    if decode.get("method") == NO_DECODE:
        extra = sorted(set(given) - {"method"})
        if extra:
            raise EvictionConfigError(
                f"--kv-decode-eviction none with --kv-decode-{extra[0]}: a request without a decode-time cap "
                "takes no decode setting; drop one of them"
            )
        return {"method": NO_DECODE}
    if "method" not in decode:
        raise EvictionConfigError(
            "--kv-decode-budget/--kv-decode-interval/--kv-decode-config/--kv-decode-allocation need "
            f"--kv-decode-eviction METHOD; valid methods: {', '.join(decode_method_names())}"
        )
    if "budget" not in decode:
        raise EvictionConfigError(
            f"--kv-decode-eviction {decode['method']} needs --kv-decode-budget (e.g. 2048): {budget_rule()}"
        )
    return decode


def apply_eviction_to_engine_args(args: argparse.Namespace, engine_args: Any) -> None:
    """Put the eviction config into ``engine_args.additional_config`` and apply the start-up guard rails,
    each stated in one log line. The ``vllm serve`` path (``vllm_patches.install_cli_hooks``): a bad setting
    or a refusal of the rails exits with one line, the only place either becomes an exit."""
    try:
        config = eviction_config_from_args(args, engine_args.additional_config)
        if config is None:
            return
        additional = dict(engine_args.additional_config or {})
        additional[ADDITIONAL_CONFIG_KEY] = config.to_dict()
        engine_args.additional_config = additional
        apply_guard_rails(engine_args, config)
    except EvictionConfigError as exc:  # GuardRailError included
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


def apply_guard_rails(engine_args: Any, config: EvictionConfig) -> None:
    """Settings eviction needs; every change is logged, none is silent. Raises GuardRailError naming a
    setting eviction cannot run with."""
    logger.info("kv-eviction: %s", config.describe())
    if (getattr(engine_args, "pipeline_parallel_size", 1) or 1) > 1:
        raise GuardRailError(
            f"--pipeline-parallel-size {engine_args.pipeline_parallel_size} is not supported with "
            "--kv-eviction (layers are indexed globally while a pipeline stage holds a slice of them); use "
            "--tensor-parallel-size instead"
        )
    if getattr(engine_args, "speculative_config", None):
        raise GuardRailError(
            "--speculative-config is not supported with --kv-eviction (never tested, and vLLM refuses the "
            "per-request vllm_xargs validator, a logits processor, with speculative decoding); drop one of "
            "them"
        )
    if engine_args.enable_prefix_caching is not False:
        logger.info(
            "kv-eviction: prefix caching stays on; a request evicting its whole prompt reads cached blocks "
            "(kept whole, shared), compacts into spare blocks where the pool has room and publishes its full "
            "prompt blocks (else only those it frees); one evicting between chunks or while generating "
            "neither reads nor publishes"
        )
    if engine_args.enable_chunked_prefill is not False and not config.keeps_chunked_prefill:
        logger.info(
            "kv-eviction: chunked prefill turned off (a decode-time cap needs whole prompts: one eviction "
            "per prompt); max_num_batched_tokens must be >= max_model_len"
        )
        engine_args.enable_chunked_prefill = False
    if not engine_args.enforce_eager:
        keep_attention_out_of_graphs(engine_args)
    select_cuda_backend(engine_args)
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0":
        logger.info("kv-eviction: VLLM_USE_V2_MODEL_RUNNER=0 (eviction hooks the V1 model runner)")
        # Set before the EngineCore and workers are spawned, so every child process inherits it.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def keep_attention_out_of_graphs(engine_args: Any, is_cuda: bool | None = None) -> None:
    """The model stays compiled: attention is a splitting op of vLLM's compilation, so the evicting backend
    (per-step metadata, scoring, compaction in Python) runs eagerly between the compiled pieces. What would
    freeze it is refused or downgraded here, with one log line: no splitting ops (attention inside the
    compiled graph) stops start-up; on CUDA a graph mode that captures attention (FULL, FULL_DECODE_ONLY,
    FULL_AND_PIECEWISE, or vLLM's default, which is one of them) becomes PIECEWISE."""
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode

    config = engine_args.compilation_config
    if isinstance(config, dict):
        config = engine_args.compilation_config = CompilationConfig(**config)
    if config.splitting_ops is not None and not any("attention" in op for op in config.splitting_ops):
        raise GuardRailError(
            f"--compilation-config splitting_ops={config.splitting_ops} compiles attention into the graph, "
            "where eviction cannot run; leave splitting_ops unset or use --enforce-eager"
        )
    if is_cuda is None:
        from vllm.platforms import current_platform

        is_cuda = current_platform.is_cuda()
    if not is_cuda:
        logger.info(
            "kv-eviction: the model runs compiled; attention (a splitting op) evicts between the pieces"
        )
        return
    mode = config.cudagraph_mode
    if mode not in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        logger.info(
            "kv-eviction: cudagraph_mode %s -> PIECEWISE (full CUDA graphs capture attention, whose eviction "
            "metadata is built per step in Python); the model keeps piecewise CUDA graphs",
            "default" if mode is None else mode.name,
        )
        config.cudagraph_mode = CUDAGraphMode.PIECEWISE


def select_cuda_backend(engine_args: Any, is_cuda: bool | None = None) -> None:
    """On CUDA, eviction runs in the evicting Triton attention backend, registered as ``CUSTOM``.

    On CPU the plugin overrides ``CPU_ATTN`` itself (vLLM ignores --attention-backend there)."""
    if is_cuda is None:
        from vllm.platforms import current_platform

        is_cuda = current_platform.is_cuda()
    if not is_cuda:
        return
    chosen = engine_args.attention_backend
    if chosen is not None and str(getattr(chosen, "name", chosen)).upper() != "CUSTOM":
        raise GuardRailError(
            f"--attention-backend {getattr(chosen, 'name', chosen)} cannot evict; with --kv-eviction leave "
            "it unset or use CUSTOM (the evicting Triton attention backend)"
        )
    if chosen is None:
        logger.info("kv-eviction: attention backend CUSTOM (the evicting Triton attention backend)")
        engine_args.attention_backend = "CUSTOM"
