"""Forced preemption with a decode-time cap (issue 12, item 4): capped requests decode beside uncapped ones
that grow until the small pool runs out; vLLM preempts and recomputes requests whose cap has already
evicted entries. A recomputed capped request is compacted straight to its cap in the recompute step
(``PromptEviction._capped_work``) while the scheduler frees the blocks of the rule at that length.
Every request must complete with all its tokens and leave no block and no worker state behind.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from reliability_traffic import (
    PREEMPTIONS,
    long_ids,
    wait_for_metric_zero,
    wait_for_usage_zero,
    wait_for_worker_state_empty,
)
from request_bodies import client_of, ignore_eos_body

from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BLOCK_SIZE = 32
NUM_BLOCKS = 40
CAP = 96
SERVER_ARGS = (
    "--kv-eviction",
    "snapkv",
    "--kv-budget",
    "64",
    "--kv-decode-eviction",
    "h2o",
    "--kv-decode-budget",
    str(CAP),
    "--block-size",
    str(BLOCK_SIZE),
    "--num-gpu-blocks-override",
    str(NUM_BLOCKS),
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "8",
)
OUTPUT_TOKENS = 500


@pytest.fixture(scope="module")
def capped_server(model_dir: Path):
    with VLLMServer(model_dir, extra_args=SERVER_ARGS) as launched:
        yield launched


def generate(server: VLLMServer, prompt: list[int], xargs: dict | None) -> int:
    result = client_of(server, timeout_s=900).completions.create(
        model=server.served_model_name,
        prompt=prompt,
        max_tokens=OUTPUT_TOKENS,
        temperature=0,
        extra_body=ignore_eos_body(xargs),
    )
    return result.usage.completion_tokens


def decode_evictions(server: VLLMServer) -> float:
    return sum(value for _, value in server.metric_samples("vllm_kvevict_decode_evictions_total"))


def test_capped_requests_preempted_after_their_first_evictions_complete_and_free_everything(
    capped_server, tokenizer
):
    """Two uncapped requests (100-token prompts) grow to 19 blocks each; three capped ones (300-token
    prompts compacted to 76, capped at 96 from t = 52) hold 6; 56 > 40 blocks: vLLM must preempt."""
    uncapped = [(long_ids(tokenizer, 100, seed), {"kv_eviction": "none"}) for seed in (1, 2)]
    capped = [(long_ids(tokenizer, 300, seed), None) for seed in (3, 4, 5)]
    preemptions_before = capped_server.metric_value(PREEMPTIONS)
    with ThreadPoolExecutor(5) as pool:
        done = list(pool.map(lambda job: generate(capped_server, *job), uncapped + capped))
    assert done == [OUTPUT_TOKENS] * 5
    assert capped_server.metric_value(PREEMPTIONS) > preemptions_before
    assert decode_evictions(capped_server) >= 3 * ((OUTPUT_TOKENS - 52) // BLOCK_SIZE - 2)
    assert wait_for_usage_zero(capped_server) == 0
    assert wait_for_worker_state_empty(capped_server) == 0
    assert wait_for_metric_zero(capped_server, "vllm_kvevict_kv_blocks_saved", 30) == 0
