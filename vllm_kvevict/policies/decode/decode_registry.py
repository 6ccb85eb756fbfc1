"""The decode-time names of the one registry (``policies/registry.py``, ``decode=`` on a method's line), where
settings and flags import them; ``_METHODS`` is the registry's view: name -> (decode form, description)."""

from __future__ import annotations

from vllm_kvevict.policies.decode.decode_scored import DecodeForm
from vllm_kvevict.policies.registry import (
    build_decode_policy,
    decode_method_description,
    decode_method_names,
    decode_method_params,
    decode_methods,
)

_METHODS = decode_methods()

__all__ = [
    "DecodeForm",
    "build_decode_policy",
    "decode_method_description",
    "decode_method_names",
    "decode_method_params",
]
