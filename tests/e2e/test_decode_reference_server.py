"""The decode-time cap inside vLLM equals the HF capped reference along 600 teacher-forced steps (issue 12).

One request goes through a real ``vllm serve`` with RoCo capping every KV head at 128 entries while it
generates (re-scored every 32-token block; the ~200-token prompt is within the prefill budget, so the cap
alone evicts). HF transformers (float32, ``vllm_kvevict.hf_reference.decode_eviction``) is then fed vLLM's
600 greedy tokens with the cache capped by the same policy code on the server's schedule (the request plan's
``rescores_at`` / ``kept_length``). Each step's log-probability of vLLM's token must match the capped
reference within bf16 tolerance, and where the cap moves the reference away from the full cache, vLLM must
side with the capped run (the control that makes the check able to fail).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from reference_checks import (
    assert_vllm_sides_with_the_eviction,
    logprob_gap,
    near_tie_margin,
    tokens_and_logprobs,
)

from vllm_kvevict.cli.server_process import VLLMServer
from vllm_kvevict.hf_reference.decode_agreement import plan_schedule
from vllm_kvevict.hf_reference.decode_eviction import DecodeCap, capped_decode
from vllm_kvevict.layout.accounting import RequestPlan, plan_request, with_decode_cap
from vllm_kvevict.policies import build_policy
from vllm_kvevict.policies.decode import build_decode_policy

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BLOCK_SIZE = 32
CAP = 128
NEW_TOKENS = 600
NUM_LAYERS = 30
PREFILL_BUDGET = 1024  # above the prompt: the prompt is kept whole, only the decode-time cap evicts
SERVER_ARGS = (
    "--kv-eviction", "snapkv", "--kv-budget", str(PREFILL_BUDGET),
    "--kv-decode-eviction", "roco", "--kv-decode-budget", str(CAP),
    "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024", "--max-num-batched-tokens", "1024",
    "--max-num-seqs", "4",
)  # fmt: skip
PROMPT = (
    "The harbour log of the lighthouse on Gull Point.\n"
    + "\n".join(
        f"Day {day}: the {ship} came in from {port} with {load} crates of {cargo}."
        for day, (ship, port, load, cargo) in enumerate(
            zip(
                ["Osprey", "Heron", "Tern", "Petrel", "Gannet", "Skua", "Fulmar", "Puffin"] * 2,
                ["Bergen", "Cork", "Brest", "Vigo", "Leith", "Hull", "Bilbao", "Porto"] * 2,
                [12, 40, 7, 33, 25, 18, 51, 9, 14, 22, 37, 6, 28, 45, 11, 30],
                ["salt", "wool", "tea", "rope", "tin", "oil", "cod", "wine"] * 2,
                strict=True,
            ),
            start=1,
        )
    )
    + "\nWrite the keeper's long diary of the following weeks, day by day:\n"
)


@dataclass(frozen=True)
class Run:
    """vLLM's greedy tokens [T] with their log-probabilities [T], and HF's [T, vocab] log-probabilities along
    them with the cache capped as on the server (capped) and whole (full); plan: the server's request plan."""

    tokens: torch.Tensor
    vllm_logprobs: torch.Tensor
    capped: torch.Tensor
    full: torch.Tensor
    plan: RequestPlan

    def gap(self, logprobs: torch.Tensor) -> torch.Tensor:
        """[T] |log p_vllm(token) - log p_ref(token)| per step."""
        return logprob_gap(self.vllm_logprobs, self.tokens, logprobs)


def generate_in_vllm(server: VLLMServer, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="unused", timeout=1800, max_retries=0)
    result = client.completions.create(
        model=server.served_model_name, prompt=prompt_ids, max_tokens=NEW_TOKENS, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    return tokens_and_logprobs(result.choices[0].logprobs)


@pytest.fixture(scope="module")
def run(model_dir) -> Run:
    from vllm_kvevict.hf_reference.model import load_reference_model

    model, tokenizer = load_reference_model(model_dir, dtype=torch.float32)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    with VLLMServer(model_dir, extra_args=SERVER_ARGS) as server:
        tokens, vllm_logprobs = generate_in_vllm(server, prompt_ids)
    plan = with_decode_cap(
        plan_request(len(prompt_ids), PREFILL_BUDGET, BLOCK_SIZE, build_policy("snapkv"), NUM_LAYERS),
        CAP,
        None,
    )
    capped = DecodeCap(build_decode_policy("roco"), plan.decode_cap, schedule=plan_schedule(plan))
    reference = capped_decode(
        model,
        torch.tensor(prompt_ids),
        [capped, DecodeCap(None)],
        steps=len(tokens),
        interval=plan.decode_interval,
        forced=tokens,
        keep_logits=True,
    )
    assert reference.logits is not None
    logprobs = torch.log_softmax(reference.logits.float(), dim=-1)
    return Run(tokens, vllm_logprobs, capped=logprobs[0], full=logprobs[1], plan=plan)


def test_the_cap_evicts_many_times_along_the_run(run: Run):
    assert len(run.tokens) == NEW_TOKENS
    assert not run.plan.compacts  # the prompt was kept whole: every eviction is the decode-time cap's
    rescores = [t for t in range(1, NEW_TOKENS) if run.plan.rescores_at(t)]
    assert len(rescores) >= NEW_TOKENS // BLOCK_SIZE - 1, rescores  # every block once the cap is reached


def test_600_capped_steps_match_the_hf_reference(run: Run):
    gap = run.gap(run.capped)
    assert float(gap.mean()) < 0.03 and float(gap.quantile(0.99)) < 0.25 and float(gap.max()) < 0.6, (
        f"mean {gap.mean():.4f} p99 {gap.quantile(0.99):.4f} max {gap.max():.4f} at step {int(gap.argmax())}"
    )
    # vLLM's greedy token is the reference's best, or within a near-tie of it (bf16 vs float32).
    assert float(near_tie_margin(run.tokens, run.capped).max()) < 0.25


def test_vllm_follows_the_capped_reference_where_the_cap_changes_the_output(run: Run):
    """The control: where the cap moves HF's log-probability of vLLM's token by more than 0.1, vLLM sides
    with the capped run, not the full cache (so the check above can fail)."""
    assert_vllm_sides_with_the_eviction(run.vllm_logprobs, run.tokens, run.capped, run.full, min_moved=10)
    assert float(run.gap(run.capped).mean()) < 0.5 * float(run.gap(run.full).mean())
