"""Preemption and aborts of evicting requests that share prefix-cache blocks (issue 30).

Six requests share a 320-token prefix (10 blocks) and each has a 300-token part of its own, compacted to 64
tokens per KV head; all six decode 256 tokens at once on the small pool of ``reliability_traffic`` (40
blocks), so vLLM preempts some. A preempted sharer gives back only what it owns (the shared blocks stay with
the other holders), is recomputed from whatever the cache then holds, and is compacted again. Every request
must complete, the cache must have been read, and once all are done no block and no worker state is left.
A client that hangs up mid-decode leaves nothing either.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from reliability_traffic import PREEMPTIONS, long_ids, wait_for_usage_zero, wait_for_worker_state_empty
from request_bodies import client_of, ignore_eos_body

pytestmark = [pytest.mark.e2e, pytest.mark.model]

NUM_REQUESTS = 6
PREFIX_TOKENS = 320
OWN_TOKENS = 300
OUTPUT_TOKENS = 256
HITS = "vllm:prefix_cache_hits_total"


def generate(server, prompt: list[int], max_tokens: int = OUTPUT_TOKENS) -> list[int]:
    result = client_of(server, timeout_s=900).completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body=ignore_eos_body(return_token_ids=True),
    )
    return list(result.choices[0].token_ids)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    prefix = long_ids(tokenizer, PREFIX_TOKENS, seed=500)
    return [prefix + long_ids(tokenizer, OWN_TOKENS, seed=501 + index) for index in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def storm(server, prompts) -> dict:
    generate(server, prompts[0], 1)  # the prefix is published by an evicting request
    hits, preemptions = server.metric_value(HITS), server.metric_value(PREEMPTIONS)
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        answers = list(pool.map(lambda prompt: generate(server, prompt), prompts))
    return {
        "answers": answers,
        "hits": server.metric_value(HITS) - hits,
        "preemptions": server.metric_value(PREEMPTIONS) - preemptions,
    }


def test_sharers_read_the_cache_and_the_pool_preempts_them(storm):
    assert storm["hits"] >= PREFIX_TOKENS * (NUM_REQUESTS - 1)
    assert storm["preemptions"] > 0


def test_every_preempted_sharer_completes_with_all_its_tokens(storm):
    assert [len(answer) for answer in storm["answers"]] == [OUTPUT_TOKENS] * NUM_REQUESTS


def test_a_sharer_dropped_mid_decode_leaves_no_block_and_no_worker_state(server, storm, prompts):
    timed = time.monotonic()
    generate(server, prompts[1], 64)
    # the time of a 64-token answer cuts a 256-token one mid-decode, even when the load beside it changes
    client = client_of(server, timeout_s=time.monotonic() - timed)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(
            model=server.served_model_name, prompt=prompts[2], max_tokens=OUTPUT_TOKENS, temperature=0,
            extra_body=ignore_eos_body(),
        )
    assert wait_for_usage_zero(server) == 0
    assert wait_for_worker_state_empty(server) == 0


def test_after_the_storm_no_block_and_no_worker_state_is_left_behind(server, storm):
    assert wait_for_usage_zero(server) == 0
    assert wait_for_worker_state_empty(server) == 0
