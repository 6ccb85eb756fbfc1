"""Preemption and aborts of requests reading a kept context (``kv_context: "keep"``, issue 30 item 3).

A creator compresses a 610-token document (its 608-token context kept at 64 entries per KV head: 2 blocks);
six readers then add 150 tokens of their own each and decode 256 tokens at once on the small pool of
``reliability_traffic`` (40 blocks), so vLLM preempts some. A preempted reader gives back only its own blocks
(the entry's stay with the other readers, or cached), is recomputed from the entry while it is intact (or
computes its prompt and keeps its own context), and completes. Once all are done no block and no worker
state is left; a reader whose client hangs up mid-decode leaves nothing either.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from reliability_traffic import PREEMPTIONS, long_ids, wait_for_usage_zero, wait_for_worker_state_empty
from request_bodies import client_of, ignore_eos_body

pytestmark = [pytest.mark.e2e, pytest.mark.model]

NUM_READERS = 6
DOCUMENT_TOKENS = 610
OWN_TOKENS = 150
OUTPUT_TOKENS = 256
KEEP = {"kv_eviction": "snapkv", "kv_budget": 64, "kv_context": "keep"}
CONTEXTS = "vllm_kvevict_kept_contexts_total"


def contexts(server) -> dict[str, float]:
    return {labels["event"]: value for labels, value in server.metric_samples(CONTEXTS)}


def generate(server, prompt: list[int], max_tokens: int = OUTPUT_TOKENS, timeout_s: float = 900) -> list[int]:
    result = client_of(server, timeout_s=timeout_s).completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={**ignore_eos_body(return_token_ids=True), "vllm_xargs": KEEP},
    )
    return list(result.choices[0].token_ids)


@pytest.fixture(scope="module")
def document(tokenizer) -> list[int]:
    return long_ids(tokenizer, DOCUMENT_TOKENS, seed=700)


@pytest.fixture(scope="module")
def storm(server, tokenizer, document) -> dict:
    before = contexts(server)
    generate(server, document, 1)  # the creator
    kept = contexts(server)
    preemptions = server.metric_value(PREEMPTIONS)
    readers = [document + long_ids(tokenizer, OWN_TOKENS, seed=701 + index) for index in range(NUM_READERS)]
    with ThreadPoolExecutor(NUM_READERS) as pool:
        answers = list(pool.map(lambda prompt: generate(server, prompt), readers))
    return {
        "readers": readers,
        "answers": answers,
        "kept": kept.get("kept", 0) - before.get("kept", 0),
        "read": contexts(server).get("read", 0) - kept.get("read", 0),
        "preemptions": server.metric_value(PREEMPTIONS) - preemptions,
    }


def test_readers_start_from_the_entry_and_the_pool_preempts_them(storm):
    assert storm["kept"] == 1
    assert storm["read"] >= NUM_READERS  # every reader, and each recomputed one that found it again
    assert storm["preemptions"] > 0


def test_every_preempted_reader_completes_with_all_its_tokens(storm):
    assert [len(answer) for answer in storm["answers"]] == [OUTPUT_TOKENS] * NUM_READERS


def test_a_reader_dropped_mid_decode_leaves_no_block_and_no_worker_state(server, storm):
    timed = time.monotonic()
    generate(server, storm["readers"][1], 64)
    with pytest.raises(openai.APITimeoutError):
        generate(server, storm["readers"][2], 64, timeout_s=(time.monotonic() - timed) / 2)
    assert wait_for_usage_zero(server) == 0
    assert wait_for_worker_state_empty(server) == 0


def test_after_the_storm_no_block_and_no_worker_state_is_left_behind(server, storm):
    assert wait_for_usage_zero(server) == 0
    assert wait_for_worker_state_empty(server) == 0
