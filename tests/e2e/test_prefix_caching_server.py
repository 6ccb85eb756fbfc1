"""Prefix caching stays on beside eviction, and compacted requests never touch shared blocks.

One server (``--kv-eviction ada-snapkv --kv-budget 64``, vLLM's default prefix caching) gets two prompts that
share a 900-token prefix: A is kept whole (``vllm_xargs: {"kv_eviction": "none"}``), B is compacted. They
alternate, B first. A compacted request must neither publish its blocks (A's first run would then start
from blocks B overwrote) nor read A's cached blocks (it would compact them in place under A's later runs):
every A answer equals A's first one, computed with no cache hit, and every B answer equals B's first one;
A's later runs do hit the cache; usage returns to 0.
"""

from __future__ import annotations

import time

import pytest

from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

SERVER_ARGS = (
    "--kv-eviction",
    "ada-snapkv",
    "--kv-budget",
    "64",
    "--block-size",
    "32",
    "--max-model-len",
    "2048",
)
HITS = "vllm:prefix_cache_hits_total"
USAGE = "vllm:kv_cache_usage_perc"


def shared_prefix(tokenizer, num_tokens: int) -> list[int]:
    lines = ["Inventory of the northern warehouse."]
    while len(tokenizer("\n".join(lines))["input_ids"]) < num_tokens:
        lines.append(f"Shelf {len(lines)} holds {len(lines) * 7 % 97} boxes of item {len(lines) * 13 % 89}.")
    return tokenizer("\n".join(lines))["input_ids"]


@pytest.fixture(scope="module")
def runs(model_dir):
    from openai import OpenAI
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prefix = shared_prefix(tokenizer, 900)
    prompt_a = prefix + tokenizer("\nHow many boxes are on shelf 12? Answer:")["input_ids"]
    prompt_b = prefix + tokenizer("\nWhich item is on shelf 30? Answer:")["input_ids"]
    whole = {"vllm_xargs": {"kv_eviction": "none"}}
    answers: dict[str, list[str]] = {"A": [], "B": []}
    hits = []
    with VLLMServer(model_dir, extra_args=SERVER_ARGS) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)
        for label in ("B", "A", "B", "A", "B", "A"):
            prompt, extra = (prompt_a, whole) if label == "A" else (prompt_b, {})
            answer = client.completions.create(
                model=server.served_model_name, prompt=prompt, max_tokens=16, temperature=0, extra_body=extra
            )
            answers[label].append(answer.choices[0].text)
            hits.append(server.metric_value(HITS))
        deadline = time.monotonic() + 60
        while server.metric_value(USAGE) > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        usage = server.metric_value(USAGE)
        compacted = server.metric_value("vllm_kvevict_requests_compacted_total")
    return answers, hits, usage, compacted


def test_compacted_requests_publish_nothing_and_whole_ones_hit_the_cache(runs):
    _, hits, _, compacted = runs
    assert compacted == 3  # every B
    assert hits[0] == 0 and hits[1] == 0  # B published nothing: A's first run found no cached block
    assert hits[3] > 0  # A's second run reads A's first run's blocks


def test_answers_do_not_depend_on_what_the_cache_held(runs):
    answers, _, usage, _ = runs
    assert len(set(answers["A"])) == 1, answers["A"]
    assert len(set(answers["B"])) == 1, answers["B"]
    assert usage == 0.0
