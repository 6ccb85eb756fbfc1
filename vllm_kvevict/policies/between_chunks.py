"""The selection a method uses between chunks of a prompt evicted while it arrives (chunked prefill)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm_kvevict.policies.adakv import AdaKV
from vllm_kvevict.policies.base import (
    EvictionPolicy,
    KeptTokens,
    LayerKV,
    ScoredPolicy,
    check_choice,
    check_fraction,
)
from vllm_kvevict.policies.criticalkv import CriticalKV
from vllm_kvevict.policies.keydiff import KeyDiff
from vllm_kvevict.policies.selection import top_k_mask

#: How a prompt is judged between chunks: by the method's own scores from the chunk's last queries
#: ("window"), by key distinctiveness alone ("keydiff"), or half each ("blend").
BETWEEN_KINDS: tuple[str, ...] = ("window", "keydiff", "blend")
#: The chunk's last queries are mid-document text that does not look at a needle the question will ask for;
#: half the intermediate budget by KeyDiff keeps it (docs/quality.md, "Per-chunk eviction").
DEFAULT_BETWEEN = "blend"


@dataclass
class Blend(EvictionPolicy):
    """``first_share`` of each head's budget chosen by ``first`` (a uniform policy: its own selection), the
    rest by ``second``'s scores among the tokens the first left; every head keeps ``budget``."""

    first: EvictionPolicy
    second: ScoredPolicy
    first_share: float = 0.5

    def __post_init__(self) -> None:
        check_fraction(type(self).__name__, "first_share", self.first_share, 0.0, 1.0)

    @property
    def min_budget(self) -> int:
        return max(self.first.min_budget, self.second.min_budget)

    def query_window(self, num_tokens: int) -> int:
        return max(self.first.query_window(num_tokens), self.second.query_window(num_tokens))

    def select(self, layer: LayerKV, budget: int) -> KeptTokens:
        if (everything := self.keep_all_or_check(layer, budget)) is not None:
            return everything
        share = min(budget, max(int(budget * self.first_share), self.first.min_budget, 1))
        first = self.first.select(layer, share)
        stage1 = first.to_mask(layer.num_tokens)
        rest = (budget - stage1.sum(dim=1)).clamp(min=0)
        second = self.second.score(layer, budget)
        return KeptTokens.from_mask(stage1 | top_k_mask(second, rest, eligible=~stage1))


def between_chunks(policy: EvictionPolicy, kind: str = DEFAULT_BETWEEN) -> EvictionPolicy:
    """The policy that keeps a prompt's intermediate budget between chunks: ``policy`` with its per-head
    allocation taken out (Ada-KV's shared stage), so every head keeps the same count and the next chunk
    scores a dense ``[H, L]`` sequence, judged as ``kind`` (``BETWEEN_KINDS``) says."""
    check_choice("between_chunks", "between", kind, BETWEEN_KINDS)
    uniform = _uniform(policy)
    if kind == "window":
        return uniform
    # KeyDiff keeps the same recent window as the method, so the next chunk sees its own context.
    keydiff = KeyDiff(window=int(getattr(uniform, "window", KeyDiff.window)))
    return Blend(uniform, keydiff) if kind == "blend" else keydiff


def _uniform(policy: EvictionPolicy) -> EvictionPolicy:
    if isinstance(policy, AdaKV):
        return policy.inner
    if isinstance(policy, CriticalKV) and isinstance(policy.inner, AdaKV):
        return dataclasses.replace(policy, inner=policy.inner.inner)
    return policy
