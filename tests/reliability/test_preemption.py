"""Forced preemption with eviction on (issue 13, item 1): the small pool of ``reliability_traffic`` cannot
hold six compacted requests decoding at once, so vLLM preempts some and recomputes them from token 0.

A recomputed request is prefilled again with its prompt and the tokens it had generated, then compacted
again. The prompt is re-scored with the same last-window queries, so it keeps the same entries (up to
rounding in a differently shaped batch); but the generated tokens are recomputed by a prefill that attends
to the *whole* prompt, while the first time they attended to the compacted one. Their KV entries, and so
the tokens after the preemption point, may differ slightly. The test requires every request to complete
and bounds the difference.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from greedy_answers import Greedy, assert_same_or_parting_at_a_near_tie
from reliability_traffic import (
    PREEMPTIONS,
    long_ids,
    wait_for_usage_zero,
    wait_for_worker_state_empty,
)
from request_bodies import client_of

from vllm_kvevict.evaluation.sequence_agreement import common_prefix_length

pytestmark = [pytest.mark.e2e, pytest.mark.model]

NUM_REQUESTS = 6
PROMPT_TOKENS = 600
OUTPUT_TOKENS = 256


def generate(server, prompt: list[int], salt: str) -> Greedy:
    """Greedy answer of exactly OUTPUT_TOKENS tokens; each run has its own cache salt (a run that found the
    other's published prompt blocks would keep them whole: docs/design.md, "Shared prefixes")."""
    result = client_of(server, timeout_s=900).completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=OUTPUT_TOKENS, temperature=0, logprobs=5,
        extra_body={"ignore_eos": True, "return_token_ids": True, "cache_salt": salt},
    )
    return Greedy.of(result.choices[0])


def run_all(server, prompts: list[list[int]], concurrency: int) -> list[Greedy]:
    salt = f"concurrency-{concurrency}"
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda prompt: generate(server, prompt, salt), prompts))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [long_ids(tokenizer, PROMPT_TOKENS, seed=100 + index) for index in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def runs(server, prompts) -> dict[str, object]:
    """Both runs on the one server: two at a time (fits the pool: no preemption), then all six at once."""
    start = server.metric_value(PREEMPTIONS)
    reference = run_all(server, prompts, concurrency=2)
    after_reference = server.metric_value(PREEMPTIONS)
    contended = run_all(server, prompts, concurrency=NUM_REQUESTS)
    return {
        "reference": reference,
        "contended": contended,
        "reference_preemptions": after_reference - start,
        "preemptions": server.metric_value(PREEMPTIONS) - after_reference,
    }


def test_the_small_pool_preempts_only_when_all_requests_run_at_once(runs):
    assert runs["reference_preemptions"] == 0
    assert runs["preemptions"] > 0


def test_every_preempted_request_completes_with_all_its_tokens(runs):
    assert [len(answer.ids) for answer in runs["contended"]] == [OUTPUT_TOKENS] * NUM_REQUESTS


#: how far below the unpreempted run's own choice (nats) the first differing token may lie.
NEAR_TIE_NATS = 2.0


def test_outputs_under_preemption_match_the_unpreempted_run_or_part_at_a_near_tie(runs):
    """Many answers are identical. Where one differs, it parts at a token the unpreempted run also ranked in
    its top 5, within NEAR_TIE_NATS of its own choice: a recomputed request's generated tokens saw the whole
    prompt once more (module docstring), which moves near-ties, not the answer's sense."""
    pairs = list(zip(runs["reference"], runs["contended"], strict=True))
    prefixes = [common_prefix_length(ref.ids, got.ids) for ref, got in pairs]
    # a third: on a CPU with AMX tiles vLLM's attention rounds differently in other batches (2 of 6 identical
    # in one full-suite run, every other one parting at a near tie); on AVX-512 without AMX most are identical
    assert sum(prefix == OUTPUT_TOKENS for prefix in prefixes) >= NUM_REQUESTS // 3, prefixes
    for ref, got in pairs:
        assert_same_or_parting_at_a_near_tie(ref, got, NEAR_TIE_NATS)


def test_after_preemption_no_block_and_no_worker_state_is_left_behind(server, runs):
    assert wait_for_usage_zero(server) == 0
    assert wait_for_worker_state_empty(server) == 0
