"""The reading of each eviction setting's value (budgets, chunk budgets, method parameters, presets) and the
error a bad one raises: one parser per kind of value, shared by the flags, ``additional_config``, presets and
``vllm_xargs``."""

from __future__ import annotations

import json
from typing import Any

import yaml

from vllm_kvevict.policies.presets import Preset, load_preset, preset_file


class EvictionConfigError(ValueError):
    """A bad eviction setting; the message names the field, the bad value and what is allowed."""


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
        named = "a string" if isinstance(raw, str) else f"a {type(raw).__name__}"
        kind = "" if from_text and isinstance(raw, str) else f"{named}, "
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


def method_entry_params(raw: dict[str, Any], field_name: str, example: str) -> Any:
    """The ``params`` of a config entry that names a method and a budget (``kv_eviction``, its ``decode``):
    {} when unset, a JSON object's text read as one. Raises EvictionConfigError naming ``field_name`` when
    the method or the budget is missing (``example``: flags that give both)."""
    if "method" not in raw or "budget" not in raw:
        raise EvictionConfigError(f"{field_name}={raw!r} needs both 'method' and 'budget' (e.g. {example})")
    params = raw.get("params") or {}
    return parse_params_json(params) if isinstance(params, str) else params


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
