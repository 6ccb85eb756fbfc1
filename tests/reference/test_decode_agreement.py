"""The server-agreement helper: a greedy run of the capped reference on the server's schedule agrees with
itself, and a changed token is reported as the first divergence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_kvevict.hf_reference import load_reference_model
from vllm_kvevict.hf_reference.decode_agreement import plan_schedule, reference_agreement
from vllm_kvevict.hf_reference.decode_eviction import DecodeCap, capped_decode
from vllm_kvevict.layout.accounting import plan_request, with_decode_cap
from vllm_kvevict.policies import build_policy
from vllm_kvevict.policies.registry import build_decode_policy

pytestmark = pytest.mark.model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
STEPS = 40


@pytest.fixture(scope="module")
def setup(model_dir: Path):
    torch.set_num_threads(2)
    model, tokenizer = load_reference_model(model_dir)
    prompt = torch.tensor(tokenizer(PROMPT)["input_ids"])
    base = plan_request(prompt.numel(), prompt.numel(), 4, build_policy("streamingllm"), 30)
    plan = with_decode_cap(base, 24, 8)
    policy = build_decode_policy("h2o", window=4)
    config = DecodeCap(policy, plan.decode_cap, schedule=plan_schedule(plan))
    greedy = capped_decode(model, prompt, [config], steps=STEPS, interval=plan.decode_interval)
    return model, prompt, plan, greedy


def test_the_plan_evicts_during_the_run(setup) -> None:
    _, prompt, plan, greedy = setup
    assert any(plan.rescores_at(t) for t in range(1, STEPS))
    assert int(greedy.max_held[0]) < prompt.numel() + STEPS - 1


def test_own_greedy_output_agrees_everywhere(setup) -> None:
    model, prompt, plan, greedy = setup
    agreement = reference_agreement(
        model, prompt, greedy.tokens[0], build_decode_policy("h2o", window=4), plan
    )
    assert agreement.first_divergence is None and agreement.rate == 1.0
    assert agreement.reference_tokens.tolist() == greedy.tokens[0].tolist()


def test_a_changed_token_is_the_first_divergence(setup) -> None:
    model, prompt, plan, greedy = setup
    tokens = greedy.tokens[0].clone()
    tokens[30] = (tokens[30] + 1) % model.config.vocab_size
    agreement = reference_agreement(model, prompt, tokens, build_decode_policy("h2o", window=4), plan)
    assert agreement.first_divergence == 30
    assert agreement.margin_at_divergence is not None and agreement.margin_at_divergence > 0
