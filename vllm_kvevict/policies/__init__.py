"""Eviction policies: pure torch, device-agnostic, no vLLM import."""

from vllm_kvevict.policies.adakv import AdaKV
from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens, LayerKV, ScoredPolicy
from vllm_kvevict.policies.criticalkv import CriticalKV
from vllm_kvevict.policies.expected_attention import ExpectedAttention
from vllm_kvevict.policies.h2o import H2O
from vllm_kvevict.policies.keydiff import KeyDiff
from vllm_kvevict.policies.knorm import KNorm
from vllm_kvevict.policies.nacl import NaCl
from vllm_kvevict.policies.pyramidkv import PyramidKV
from vllm_kvevict.policies.query_statistics import QueryStatistics
from vllm_kvevict.policies.registry import MethodInfo, available_methods, build_policy, method_names
from vllm_kvevict.policies.roco import RoCo, RocoStatistics
from vllm_kvevict.policies.snapkv import SnapKV
from vllm_kvevict.policies.streamingllm import StreamingLLM

__all__ = [
    "AdaKV",
    "CriticalKV",
    "EvictionPolicy",
    "ExpectedAttention",
    "H2O",
    "KeptTokens",
    "KeyDiff",
    "KNorm",
    "LayerKV",
    "MethodInfo",
    "NaCl",
    "PyramidKV",
    "QueryStatistics",
    "RoCo",
    "RocoStatistics",
    "ScoredPolicy",
    "SnapKV",
    "StreamingLLM",
    "available_methods",
    "build_policy",
    "method_names",
]
