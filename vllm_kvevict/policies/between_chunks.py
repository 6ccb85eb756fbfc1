"""The selection a method uses between chunks of a prompt evicted while it arrives (chunked prefill)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kvevict.policies.adakv import AdaKV
from vllm_kvevict.policies.base import (
    EvictionPolicy,
    KeptTokens,
    LayerKV,
    ScoredPolicy,
    check_choice,
    check_fraction,
    check_int,
)
from vllm_kvevict.policies.criticalkv import CriticalKV
from vllm_kvevict.policies.expected_attention import ExpectedAttention
from vllm_kvevict.policies.kept_masks import top_k_mask
from vllm_kvevict.policies.key_scored import KeyScoredPolicy
from vllm_kvevict.policies.keydiff import KeyDiff
from vllm_kvevict.policies.knorm import KNorm

#: The scores that judge a key with no queries: distinctiveness (KeyDiff) or a small L2 norm (K-norm).
KEY_SCORERS: dict[str, type[KeyScoredPolicy]] = {"keydiff": KeyDiff, "knorm": KNorm}
#: The scores that judge held entries without the question: the key scores, and Expected Attention (the
#: statistics of every query seen so far, carried across chunks in ``LayerKV.query_statistics``). Each is
#: built with the method's ``window`` and a ``span_after``.
BETWEEN_SCORERS: dict[str, type[KeyScoredPolicy] | type[ExpectedAttention]] = {
    **KEY_SCORERS,
    "expected-attention": ExpectedAttention,
}
#: How a prompt is judged between chunks: by the method's own scores from the chunk's last queries
#: ("window"), by one such score alone ("keydiff", "knorm", "expected-attention"), or by both the method and
#: one of them ("blend"); the rules measured first keep their place in the list.
BETWEEN_KINDS: tuple[str, ...] = ("window", *KEY_SCORERS, "blend", "expected-attention")
#: The kinds whose selection reads the method's own window of queries (the question echo joins it there).
WINDOW_KINDS: tuple[str, ...] = ("window", "blend")
#: The chunk's last queries are mid-document text that does not look at a needle the question will ask for;
#: half the intermediate budget by a key score keeps it (docs/quality.md, "Per-chunk eviction").
DEFAULT_BETWEEN = "blend"


@dataclass
class Blend(EvictionPolicy):
    """``first_share`` of each head's budget chosen by ``first`` (a uniform policy: its own selection), the
    rest by ``second``'s scores among the tokens the first left; every head keeps ``budget``."""

    reads_own_values: ClassVar[bool] = False

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


#: KeyDiff's span between chunks when ``between_span`` is not given: ``LONG_SPAN`` once KeyDiff chooses at
#: least ``LONG_SPAN_FROM`` tokens per head, else KeyDiff's own 8. Measured on 4k prompts (docs/quality.md,
#: "The share and the span"): a run of 16 keeps a needle's whole value after its key phrase where KeyDiff
#: chooses ~768 tokens (25 % kept), and leaves room for too few keys where it chooses ~300 (10 %).
LONG_SPAN = 16
LONG_SPAN_FROM = 512


@dataclass(frozen=True)
class BetweenRule:
    """How a prompt's held entries are judged between chunks: ``kind`` (``BETWEEN_KINDS``), the method's
    own ``share`` of the intermediate budget under "blend", the key score that takes the rest there
    (``scorer``, one of ``BETWEEN_SCORERS``; the kinds that are scorers name their own), and that score's
    ``span_after`` (a kept key also keeps the tokens after it: a needle's value); None sets the span by the
    tokens the key score chooses (``LONG_SPAN`` from ``LONG_SPAN_FROM``)."""

    kind: str = DEFAULT_BETWEEN
    share: float = 0.5
    span_after: int | None = None
    scorer: str = "keydiff"

    def __post_init__(self) -> None:
        check_choice("between_chunks", "between", self.kind, BETWEEN_KINDS)
        check_fraction("between_chunks", "between_share", self.share, 0.0, 1.0)
        if self.span_after is not None:
            check_int("between_chunks", "between_span", self.span_after, 0)
        check_choice("between_chunks", "between_scorer", self.scorer, tuple(BETWEEN_SCORERS))

    @property
    def key_scorer(self) -> str:
        """The name of the score this rule judges by besides the method (unused under "window")."""
        return self.kind if self.kind in BETWEEN_SCORERS else self.scorer

    def span_for(self, budget: int | None) -> int:
        """The key score's span when a head keeps ``budget`` entries (None: not known, the short span)."""
        if self.span_after is not None:
            return self.span_after
        keyed_tokens = (budget or 0) * (1.0 - self.share if self.kind == "blend" else 1.0)
        return LONG_SPAN if keyed_tokens >= LONG_SPAN_FROM else KeyScoredPolicy.span_after

    def describe(self) -> str:
        if self.kind == "window":
            return "between=window"
        share = f" share={self.share:g} scorer={self.scorer}" if self.kind == "blend" else ""
        by_budget = f"{LONG_SPAN}-from-{LONG_SPAN_FROM}-else-{KeyScoredPolicy.span_after}"
        span = self.span_after if self.span_after is not None else by_budget
        return f"between={self.kind}{share} span={span}"


def between_chunks(
    policy: EvictionPolicy,
    rule: BetweenRule | str = DEFAULT_BETWEEN,
    budget: int | None = None,
    tail: int = 0,
) -> EvictionPolicy:
    """The policy that keeps a prompt's intermediate budget between chunks: ``policy`` with its per-head
    allocation taken out (Ada-KV's shared stage), so every head keeps the same count and the next chunk
    scores a dense ``[H, L]`` sequence, judged as ``rule`` says (a kind alone takes the default share and
    span). ``budget``: the entries per head it will keep, which sets the span when the rule leaves it open.
    ``tail`` > 0: the newest ``tail`` held entries are kept whatever their scores (the arrived part of a
    trailing window, ``layout/trailing_window.py``) and the rule chooses the rest among the others."""
    if tail:
        rest = None if budget is None else budget - tail
        return KeepTail(between_chunks(policy, rule, rest), tail)
    rule = BetweenRule(rule) if isinstance(rule, str) else rule
    uniform = _uniform(policy)
    if rule.kind == "window" or (rule.kind == "blend" and uniform.scores_own_rows):
        # a method that scores each entry by its own cache row (the learned scorer) reads no window, so a
        # chunk's last window cannot mislead it: its own scores alone keep between chunks what the whole
        # prompt would keep (policies/kvzap.py)
        return uniform
    # The key score keeps the same recent window as the method, so the next chunk sees its own context.
    window = int(getattr(uniform, "window", KeyScoredPolicy.window))
    keyed = BETWEEN_SCORERS[rule.key_scorer](window=window, span_after=rule.span_for(budget))
    return Blend(uniform, keyed, first_share=rule.share) if rule.kind == "blend" else keyed


def trailing_floor(policy: EvictionPolicy, rule: BetweenRule | str = DEFAULT_BETWEEN) -> int:
    """What each head holds at least of a prompt's tokens before its trailing window between chunks
    (``RequestPlan.trailing_floor``): the least the between-chunks selection of ``policy`` keeps."""
    return between_chunks(policy, rule).min_budget


def _uniform(policy: EvictionPolicy) -> EvictionPolicy:
    if isinstance(policy, AdaKV):
        return policy.inner
    if isinstance(policy, CriticalKV) and isinstance(policy.inner, AdaKV):
        return dataclasses.replace(policy, inner=policy.inner.inner)
    return policy


@dataclass
class KeepTail(EvictionPolicy):
    """Keeps the last ``tail`` held entries whatever their scores (the arrived part of the prompt's trailing
    window, the newest held entries) and lets ``inner`` choose the rest of the budget among the others,
    as if they were the whole sequence (its own window then falls on the entries just before the tail)."""

    reads_own_values: ClassVar[bool] = False

    inner: EvictionPolicy
    tail: int = 0

    def __post_init__(self) -> None:
        check_int(type(self).__name__, "tail", self.tail, 0)

    @property
    def min_budget(self) -> int:
        return self.tail + self.inner.min_budget

    def query_window(self, num_tokens: int) -> int:
        return self.inner.query_window(num_tokens)

    def select(self, layer: LayerKV, budget: int) -> KeptTokens:
        if (everything := self.keep_all_or_check(layer, budget)) is not None:
            return everything
        n = layer.num_tokens
        tail = min(self.tail, budget)
        head_len = n - tail
        keep = torch.zeros(layer.num_kv_heads, n, dtype=torch.bool, device=layer.keys.device)
        keep[:, head_len:] = True
        if budget > tail:
            # A query inside the tail (or after it: an echo) sees every earlier entry; one before it, those
            # up to its own position.
            front = dataclasses.replace(
                layer,
                keys=layer.keys[:, :head_len],
                values=layer.values_slice(0, head_len),
                query_positions=layer.positions().clamp(max=head_len - 1),
            )
            keep[:, :head_len] = self.inner.select(front, budget - tail).to_mask(head_len)
        return KeptTokens.from_mask(keep)
