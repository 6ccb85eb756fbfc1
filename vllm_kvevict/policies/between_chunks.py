"""The selection a method uses between chunks of a prompt evicted while it arrives (chunked prefill)."""

from __future__ import annotations

import dataclasses

from vllm_kvevict.policies.adakv import AdaKV
from vllm_kvevict.policies.base import EvictionPolicy
from vllm_kvevict.policies.criticalkv import CriticalKV


def between_chunks(policy: EvictionPolicy) -> EvictionPolicy:
    """``policy`` with its per-head allocation taken out (Ada-KV's shared stage), so every head keeps the same
    count and the next chunk scores a dense ``[H, L]`` sequence; other methods unchanged."""
    if isinstance(policy, AdaKV):
        return policy.inner
    if isinstance(policy, CriticalKV) and isinstance(policy.inner, AdaKV):
        return dataclasses.replace(policy, inner=policy.inner.inner)
    return policy
