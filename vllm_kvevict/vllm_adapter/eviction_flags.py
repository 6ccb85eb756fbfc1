"""The ``--kv-eviction``, ``--kv-budget``, ``--kv-eviction-config`` and ``--kv-decode-*`` flags of
``vllm serve`` and the eviction config they give.

The flags end up in ``additional_config["kv_eviction"]``, the one piece of configuration vLLM hands to every
process (``engine_setup.apply_eviction_to_engine_args``). ``--additional-config.kv_eviction.*`` (or
``--additional-config '{"kv_eviction": ...}'``) stays the documented fallback and goes through the same
validation.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from vllm_kvevict.policies.between_chunks import BETWEEN_KINDS, BETWEEN_SCORERS
from vllm_kvevict.policies.presets import Preset
from vllm_kvevict.policies.registry import available_methods, decode_method_names, method_names
from vllm_kvevict.settings.additional_config import ADDITIONAL_CONFIG_KEY, from_wire
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.decode_config import DECODE_ALLOCATIONS, NO_DECODE, implied_decode
from vllm_kvevict.settings.parsers import (
    EvictionConfigError,
    budget_rule,
    parse_budget,
    parse_params_json,
    parse_params_or_preset,
)
from vllm_kvevict.vllm_adapter.vllm_private import parser_has_option

FLAG_GROUP_TITLE = "KVEviction"


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
    if parser_has_option(parser, "--kv-eviction"):
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
    return from_wire(merged)


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
