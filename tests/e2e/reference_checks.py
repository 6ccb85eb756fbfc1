"""Checks shared by the e2e tests that compare vLLM's greedy tokens with an HF reference.

Every input is per step along vLLM's tokens: ``vllm_logprobs`` [T] vLLM's log-probability of its token;
``tokens`` [T]; ``evicted`` / ``full`` [T, vocab] HF log-probabilities with the server's eviction reproduced
and with the full cache.
"""

from __future__ import annotations

from typing import Any

import torch


def tokens_and_logprobs(logprobs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's tokens [T] and their log-probabilities [T] from a completion choice's ``logprobs``, requested
    with ``return_tokens_as_token_ids`` (each token reads ``token_id:<id>``)."""
    tokens = [int(token.removeprefix("token_id:")) for token in logprobs.tokens]
    return torch.tensor(tokens), torch.tensor(logprobs.token_logprobs, dtype=torch.float32)


def near_tie_margin(tokens: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[T] how far vLLM's token is below the reference's best log-probability at each step (0 where they
    agree)."""
    return reference.max(dim=-1).values - reference[torch.arange(len(tokens)), tokens]


def logprob_gap(vllm_logprobs: torch.Tensor, tokens: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[T] |log p_vllm(token) - log p_ref(token)| per step."""
    return (vllm_logprobs - reference[torch.arange(len(tokens)), tokens]).abs()


def assert_vllm_sides_with_the_eviction(
    vllm_logprobs: torch.Tensor,
    tokens: torch.Tensor,
    evicted: torch.Tensor,
    full: torch.Tensor,
    min_moved: int,
) -> torch.Tensor:
    """The control that lets a reference check fail: where the eviction moves HF's log-probability of vLLM's
    token by more than 0.1 (at least ``min_moved`` steps), vLLM is closer to the evicting run than to the
    full cache at >= 90 % of them. Returns the [T] bool mask of those steps."""
    index = torch.arange(len(tokens))
    moved = (evicted[index, tokens] - full[index, tokens]).abs() > 0.1
    assert int(moved.sum()) >= min_moved, (
        "eviction barely changed this request: the comparison would prove nothing"
    )
    to_evicted = logprob_gap(vllm_logprobs, tokens, evicted)
    to_full = logprob_gap(vllm_logprobs, tokens, full)
    sided = to_evicted[moved] < to_full[moved]
    assert float(sided.float().mean()) >= 0.9, (
        f"vLLM sides with the eviction at {int(sided.sum())} of {int(moved.sum())} moved steps (needs 90 %); "
        f"steps siding with the full cache: {torch.nonzero(moved).flatten()[~sided].tolist()}, their gaps to "
        f"the evicting run {to_evicted[moved][~sided].tolist()} and to the full cache "
        f"{to_full[moved][~sided].tolist()}"
    )
    return moved


def assert_agrees_along_the_run(
    vllm_logprobs: torch.Tensor, tokens: torch.Tensor, evicted: torch.Tensor
) -> None:
    """Along a long run, the per-step |delta log p| of vLLM's token against the evicting reference has mean
    < 0.03, p99 < 0.25 and max < 0.6, and vLLM's token is the reference's best or within 0.25 of it (a
    near-tie: bf16 against float32)."""
    gap = logprob_gap(vllm_logprobs, tokens, evicted)
    assert float(gap.mean()) < 0.03 and float(gap.quantile(0.99)) < 0.25 and float(gap.max()) < 0.6, (
        f"mean {gap.mean():.4f} p99 {gap.quantile(0.99):.4f} max {gap.max():.4f} at step {int(gap.argmax())}"
    )
    assert float(near_tie_margin(tokens, evicted).max()) < 0.25
