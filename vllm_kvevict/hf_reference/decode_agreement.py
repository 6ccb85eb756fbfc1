"""Does a server's greedy output agree with the HF reference under the same decode-time cap?

Given the prompt and the tokens the server generated, the reference decodes teacher-forced along the
server's tokens with the cache capped by the same policy on the server's schedule (the request plan's
``rescores_at``/``kept_length``, a pure function of prompt length, cap, interval and block size), and at
every step compares its own greedy choice with the server's token. Teacher forcing keeps both on the same
sequence after a divergence, so the agreement rate over all steps stays meaningful.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from vllm_kvevict.hf_reference.decode_eviction import DecodeCap, capped_decode
from vllm_kvevict.layout.accounting import RequestPlan
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy


@dataclass(frozen=True)
class Agreement:
    """Reference vs server along the server's tokens.

    steps: tokens compared; first_divergence: the first step whose reference argmax differs from the
    server's token (None: none); agreeing: steps where they are equal; margin_at_divergence: the
    reference's logit of its own choice minus that of the server's token there (near 0: a tie that float
    rounding can flip); reference_tokens: [steps] the reference's greedy choice at each step.
    """

    steps: int
    first_divergence: int | None
    agreeing: int
    margin_at_divergence: float | None
    reference_tokens: torch.Tensor

    @property
    def rate(self) -> float:
        return self.agreeing / self.steps if self.steps else 1.0


def plan_schedule(plan: RequestPlan) -> Callable[[int], int | None]:
    """The server's re-score rule for a request: after t generated tokens are in the cache, re-score to
    ``kept_length(t)`` entries per head when ``rescores_at(t)``. Only plans that did not compact the
    prompt: the reference starts decode-time eviction from the full prompt."""
    if plan.compacts:
        raise ValueError("the decode-time reference starts from the full prompt; this plan compacts it")
    if not plan.decode_cap:
        raise ValueError("the plan has no decode-time cap")
    return lambda t: plan.kept_length(t) if plan.rescores_at(t) else None


@torch.inference_mode()
def reference_agreement(
    model: PreTrainedModel,
    prompt_ids: Sequence[int] | torch.Tensor,
    server_tokens: Sequence[int] | torch.Tensor,
    policy: DecodeEvictionPolicy | None,
    plan: RequestPlan | None = None,
) -> Agreement:
    """Compare the server's greedy ``server_tokens`` for ``prompt_ids`` with the capped HF reference.

    policy: the decode-time method the server ran (None: no cap, the full cache); plan: the server's
    request plan with its decode cap and interval (``layout.accounting.with_decode_cap``), needed with a
    policy. Returns an ``Agreement``.
    """
    prompt = torch.as_tensor(prompt_ids, dtype=torch.int64).reshape(-1)
    tokens = torch.as_tensor(server_tokens, dtype=torch.int64).reshape(-1)
    if tokens.numel() == 0:
        raise ValueError("server_tokens is empty")
    if policy is None:
        config, interval = DecodeCap(None), 1
    else:
        if plan is None:
            raise ValueError(
                "a capped comparison needs the server's request plan (cap, interval, block size)"
            )
        config = DecodeCap(policy, plan.decode_cap, schedule=plan_schedule(plan))
        interval = plan.decode_interval
    run = capped_decode(
        model, prompt, [config], steps=tokens.numel(), interval=interval, forced=tokens, keep_logits=True
    )
    assert run.logits is not None
    logits = run.logits[0]
    choice = logits.argmax(dim=-1)
    differs = (choice != tokens).nonzero()
    first = int(differs[0]) if differs.numel() else None
    margin = None
    if first is not None:
        margin = float(logits[first, choice[first]] - logits[first, tokens[first]])
    return Agreement(
        steps=tokens.numel(),
        first_divergence=first,
        agreeing=int((choice == tokens).sum()),
        margin_at_divergence=margin,
        reference_tokens=choice,
    )
