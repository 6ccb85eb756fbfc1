"""Per-chunk eviction keeps what the request alone decides, whatever else runs (issue 32 item 5).

A float32 server evicts prompts chunk by chunk (``"prefill": "chunked"``, 512-token steps, so the chunk
stride is 512). Four 2,000-token prompts are answered greedily one at a time, then all at once: under load
vLLM's token budget cuts their prompts at other places (decoding requests take part of each step), but the
scheduler stops every chunk at a multiple of the stride and the worker evicts only there, so each request
keeps the same entries and answers with the same tokens. Float32 so that the batch shape cannot flip a
near-tie through rounding (whole-prompt eviction is identical alone and under load in bf16 too).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_kvevict.bench.workload import build_workload
from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

PROMPTS = 4
PROMPT_TOKENS = 2000
NEW_TOKENS = 24
SERVER_ARGS = (
    "--dtype", "float32", "--kv-eviction", "ada-snapkv", "--kv-budget", "0.1", "--block-size", "32",
    "--max-model-len", "2200", "--max-num-batched-tokens", "512", "--no-enable-prefix-caching",
    "--kv-eviction-config", '{"prefill": "chunked", "chunk_budget": 256}',
)


@pytest.fixture(scope="module")
def answers(model_dir) -> dict[str, list[list[int]]]:
    from openai import OpenAI

    prompts = build_workload(model_dir, PROMPTS, PROMPT_TOKENS, NEW_TOKENS, seed=32).prompts
    with VLLMServer(model_dir, extra_args=SERVER_ARGS) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=900, max_retries=0)

        def greedy(prompt: list[int]) -> list[int]:
            result = client.completions.create(
                model=server.served_model_name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return list(result.choices[0].token_ids)

        alone = [greedy(prompt) for prompt in prompts]
        with ThreadPoolExecutor(PROMPTS) as pool:
            loaded = list(pool.map(greedy, prompts))
        evicted = server.metric_value("vllm_kvevict_requests_compacted_total")
    return {"alone": alone, "loaded": loaded, "evicted": [[int(evicted)]]}


def test_every_prompt_was_evicted_chunk_by_chunk(answers):
    assert answers["evicted"] == [[2 * PROMPTS]]


def test_greedy_answers_alone_and_under_load_are_identical(answers):
    assert answers["loaded"] == answers["alone"]
