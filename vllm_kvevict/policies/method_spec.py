"""``method[:param=value,...]`` strings, as benchmark command lines name a method with its parameters."""

from __future__ import annotations

import json
from typing import Any


def parse_method_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``'snapkv:window=64,pooling=avg'`` -> ``('snapkv', {'window': 64, 'pooling': 'avg'})``: each value is
    read as JSON where it parses, else kept as the string. Raises ValueError for an empty method name."""
    method, _, raw_params = spec.strip().partition(":")
    if not method:
        raise ValueError(f"{spec!r} must read method[:param=value,...]")
    params: dict[str, Any] = {}
    for item in filter(None, raw_params.split(",")):
        key, _, value = item.partition("=")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return method, params
