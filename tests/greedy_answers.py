"""Greedy answers with their top log-probabilities, and the check that two of them are the same answer.

On a CPU with bf16, vLLM rounds a request's matmuls and attention by the shape of the batch it runs in. Two
runs of one greedy request in differently shaped batches (another server's step, another admission moment)
can therefore flip a near tie. The tests that compare such runs require the answers to be identical or to
part at a token the first run also ranked in its top log-probabilities, within a margin of its own choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kvevict.evaluation.sequence_agreement import common_prefix_length


@dataclass(frozen=True)
class Greedy:
    """A greedy answer: token ids, their texts and the top log-probabilities (text -> nats) at every step."""

    ids: list[int]
    tokens: list[str]
    top: list[dict[str, float]]

    @classmethod
    def of(cls, choice: Any) -> Greedy:
        """From a completion choice requested with ``logprobs=k`` and ``return_token_ids``."""
        return cls(list(choice.token_ids), list(choice.logprobs.tokens), list(choice.logprobs.top_logprobs))


def assert_same_or_parting_at_a_near_tie(first: Greedy, second: Greedy, nats: float) -> None:
    """``second`` equals ``first``, or at the first step where they differ ``second``'s token is among
    ``first``'s top log-probabilities and at most ``nats`` below ``first``'s own choice."""
    at = common_prefix_length(first.ids, second.ids)
    if at == len(first.ids) == len(second.ids):
        return
    assert at < min(len(first.ids), len(second.ids)), ("one answer is a prefix of the other", at)
    alternatives = first.top[at]
    assert second.tokens[at] in alternatives, (at, second.tokens[at], alternatives)
    gap = max(alternatives.values()) - alternatives[second.tokens[at]]
    assert gap <= nats, (at, second.tokens[at], alternatives)
