"""Checks shared by the e2e tests that compare vLLM's greedy tokens with an HF reference.

Every input is per step along vLLM's tokens: ``vllm_logprobs`` [T] vLLM's log-probability of its token;
``tokens`` [T]; ``evicted`` / ``full`` [T, vocab] HF log-probabilities with the server's eviction reproduced
and with the full cache.
"""

from __future__ import annotations

import inspect
import random
import time
from concurrent.futures import ThreadPoolExecutor
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


def travel_prompt(tokenizer, num_tokens: int, seed: int = 11) -> list[int]:
    rng = random.Random(seed)
    names = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi"]
    cities = ["Paris", "Lima", "Oslo", "Cairo", "Quito", "Seoul", "Perth", "Rome"]
    lines = ["Travel log of the club."]
    tail = "\nNow write a long story about all these journeys, day by day.\n"
    while len(tokenizer("\n".join(lines) + tail)["input_ids"]) < num_tokens:
        lines.append(
            f"On day {len(lines)}, {rng.choice(names)} went from {rng.choice(cities)} to "
            f"{rng.choice(cities)} and paid {rng.randint(10, 99)} coins."
        )
    return tokenizer("\n".join(lines) + tail)["input_ids"]


def generate_in_vllm(
    server: Any, prompt_ids: list[int], neighbours: list[list[int]], new_tokens: int, **extra_body: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``new_tokens`` greedy tokens and their log-probabilities for ``prompt_ids``, while
    ``neighbours`` (other prompts) run in the same batches: a short one from the start, the others arriving
    mid-decode, so the checked request also decodes in steps where other requests prefill and compact.
    ``extra_body`` goes into the checked request's body (e.g. ``vllm_xargs``)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="unused", timeout=1800, max_retries=0)

    def complete(ids: list[int], max_tokens: int, delay_s: float = 0.0, extra: dict | None = None):
        time.sleep(delay_s)
        return client.completions.create(
            model=server.served_model_name, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **(extra or {})},
        )

    with ThreadPoolExecutor(max_workers=1 + len(neighbours)) as pool:
        checked = pool.submit(complete, prompt_ids, new_tokens, 0.0, extra_body)
        others = [pool.submit(complete, ids, 48, 3.0 * i) for i, ids in enumerate(neighbours)]
        result = checked.result()
        assert all(o.result().usage.completion_tokens == 48 for o in others)
    return tokens_and_logprobs(result.choices[0].logprobs)


def kept_argument(evicting, kept: list) -> list:
    """``evicting`` takes one kept set per layer, or (batched form) a list of those per batch row."""
    batched = "kept_rows" in inspect.signature(evicting).parameters
    return [kept] if batched else kept


@torch.inference_mode()
def teacher_forced(model, prompt_ids: list[int], tokens: torch.Tensor, kept) -> torch.Tensor:
    """[T, vocab] float32 HF log-probabilities of each step along ``tokens`` with per-layer ``kept`` sets."""
    from vllm_kvevict.hf_reference.capture import prefill
    from vllm_kvevict.hf_reference.generation import cache_prefix, evicting

    prompt = prefill(model, torch.tensor(prompt_ids), capture=False)
    cache = cache_prefix(model, prompt)
    with evicting(model, kept_argument(evicting, kept), len(prompt_ids)):
        out = model(input_ids=tokens[None, :-1], past_key_values=cache, use_cache=True)
    # Step 0 comes from the prefill logits, before any eviction (as in vLLM).
    logits = torch.cat([prompt.last_logits[None], out.logits[0].float()])
    return torch.log_softmax(logits, dim=-1)
