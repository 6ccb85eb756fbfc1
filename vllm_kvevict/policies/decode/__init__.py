"""Decode-time eviction: per-head caps while generating, re-scored every ``interval`` tokens."""

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
    "held_attention",
]
