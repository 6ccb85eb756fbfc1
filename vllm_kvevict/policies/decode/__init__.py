"""Decode-time eviction: per-head caps while generating, re-scored every ``interval`` tokens."""

from typing import Any

from vllm_kvevict.policies.decode.decode_policy import (
    DecodeEvictionPolicy,
    DecodeState,
    ada_caps,
    ada_caps_from_scores,
    held_attention,
)
from vllm_kvevict.policies.decode.decode_scored import DecodeStreamingLLM, ScoredDecode
from vllm_kvevict.policies.decode.decode_snapkv import DecodeSnapKV
from vllm_kvevict.policies.decode.decode_states import (
    AccumulatingPolicy,
    AttentionStatistics,
    DecodeH2O,
    DecodeRoCo,
    WindowScores,
)
from vllm_kvevict.policies.decode.held_layer import HeldLayer

__all__ = [
    "AccumulatingPolicy",
    "AttentionStatistics",
    "DecodeEvictionPolicy",
    "DecodeH2O",
    "DecodeRoCo",
    "DecodeSnapKV",
    "DecodeState",
    "DecodeStreamingLLM",
    "HeldLayer",
    "ScoredDecode",
    "WindowScores",
    "ada_caps",
    "ada_caps_from_scores",
    "build_decode_policy",
    "decode_method_description",
    "decode_method_names",
    "decode_method_params",
    "held_attention",
]

#: The registry's decode names, read from it on first use: the registry imports this package's methods.
_REGISTRY_NAMES = frozenset(
    {"build_decode_policy", "decode_method_description", "decode_method_names", "decode_method_params"}
)


def __getattr__(name: str) -> Any:
    if name in _REGISTRY_NAMES:
        from vllm_kvevict.policies import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
