"""Preemption and aborts of requests evicted chunk by chunk (issue 11 item 1, issue 13's suite).

A server of its own: vLLM's chunked prefill at 128 tokens per step, so a 600-token prompt arrives in five
chunks and, alone, is evicted after three of them (at 256, 384 and 512 computed tokens, down to the
intermediate budget of 132 tokens per KV head) before its last chunk compacts it to Ada-KV's
ragged budgets. The pool of ``reliability_traffic`` (40 blocks of 32) cannot hold eight of them decoding
256 tokens each, so vLLM preempts running requests, mid-prefill or mid-decode, and recomputes them from
token 0: the worker must drop what it held for them between chunks and start the chunk rule again. One of
the eight asks for ``"kv_prefill": "whole"`` (``vllm_xargs``): it holds its whole prompt until its last
chunk, beside the others' chunk rule, through the same preemptions.

Per-chunk eviction makes a request's kept set depend on where its chunks ended, which depends on what else
shared its steps; so the contended answers are not compared with uncontended ones token by token. What is
required: every request completes with all its tokens, every one was evicted between chunks, a probe sent
alone before and after the storm answers identically (nothing left behind changes a later request), and
every block and every piece of worker state comes back, also after a client gives up mid-prefill.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from reliability_traffic import (
    BLOCK_SIZE,
    BUDGET,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    PREEMPTIONS,
    long_ids,
    wait_for_usage_zero,
    wait_for_worker_state_empty,
)
from request_bodies import client_of, ignore_eos_body

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.layout.accounting import request_planner
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

CHUNK_TOKENS = 128
NUM_REQUESTS = 8
PROMPT_TOKENS = 600
OUTPUT_TOKENS = 256
PROBE_TOKENS = 48
#: I in tokens (the default, 1.5 B' but at least 512 tokens, would leave a 600-token prompt whole until its
#: last chunk); the server's plan of a 600-token prompt: B' = 88 (600 - B' whole blocks), I = 132.
CHUNK_BUDGET = 132
PLAN = request_planner(
    BUDGET, BLOCK_SIZE, build_policy("ada-snapkv"), num_layers=30, chunk_budget=CHUNK_BUDGET
)(PROMPT_TOKENS)
SERVER_ARGS = (
    "--kv-eviction", "ada-snapkv", "--kv-budget", str(BUDGET),
    "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(NUM_REQUESTS),
    "--enable-chunked-prefill", "--max-num-batched-tokens", str(CHUNK_TOKENS),
    "--kv-eviction-config", json.dumps({"prefill": "chunked", "chunk_budget": CHUNK_BUDGET}),
)


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chunked-preemption")


@pytest.fixture(scope="module")
def chunked_server(model_dir: Path, dump_dir: Path) -> Iterator[VLLMServer]:
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, env={DEBUG_DUMP_ENV: str(dump_dir)}) as launched:
        yield launched


WHOLE_PREFILL = {"kv_prefill": "whole"}  # the storm's request 0


def greedy_ids(
    server: VLLMServer, prompt: list[int], max_tokens: int, xargs: dict | None = None
) -> list[int]:
    result = client_of(server, timeout_s=900).completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body=ignore_eos_body(xargs, return_token_ids=True),
    )
    return list(result.choices[0].token_ids)


@pytest.fixture(scope="module")
def storm(chunked_server: VLLMServer, tokenizer, dump_dir: Path) -> dict:
    """A probe alone, all requests at once, the probe alone again; preemptions and dumps of the storm."""
    probe = long_ids(tokenizer, PROMPT_TOKENS, seed=300)
    prompts = [long_ids(tokenizer, PROMPT_TOKENS, seed=310 + index) for index in range(NUM_REQUESTS)]
    probe_before = greedy_ids(chunked_server, probe, PROBE_TOKENS)
    before = chunked_server.metric_value(PREEMPTIONS)
    dumped_before = set(dump_dir.glob("*.pt"))
    xargs = [WHOLE_PREFILL] + [None] * (NUM_REQUESTS - 1)

    def answer(ids: list[int], request_xargs: dict | None) -> list[int]:
        return greedy_ids(chunked_server, ids, OUTPUT_TOKENS, request_xargs)

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        answers = list(pool.map(answer, prompts, xargs))
    preemptions = chunked_server.metric_value(PREEMPTIONS) - before
    dumps = [torch.load(path) for path in set(dump_dir.glob("*.pt")) - dumped_before]
    return {
        "probe_before": probe_before,
        "answers": answers,
        "preemptions": preemptions,
        "dumps": dumps,
        "probe_after": greedy_ids(chunked_server, probe, PROBE_TOKENS),
    }


def test_the_pool_preempts_chunk_evicted_requests(storm):
    assert storm["preemptions"] > 0


def test_every_request_completes_with_all_its_tokens(storm):
    assert [len(ids) for ids in storm["answers"]] == [OUTPUT_TOKENS] * NUM_REQUESTS


def test_every_chunked_request_was_evicted_between_chunks_down_to_the_intermediate_budget(storm):
    """Each dump is the last prefill of its request (a recompute replaces the first one's). Where a chunk
    ended depends on what shared its step, so the evicting chunks differ between requests; after each, every
    head of every layer held exactly what the scheduler's rule left blocks for, all of it already computed.
    The request that asked for ``kv_prefill: whole`` was evicted once, after its last chunk."""
    dumps = [d for d in storm["dumps"] if d["prompt_len"] == PROMPT_TOKENS]
    assert len(dumps) == NUM_REQUESTS, [d["prompt_len"] for d in storm["dumps"]]
    whole = [d for d in dumps if not d["chunks"]]
    assert len(whole) == 1, [len(d["chunks"]) for d in dumps]
    for record in dumps:
        if record is whole[0]:
            continue
        computed = [n for n, _ in record["chunks"]]
        assert computed and computed == sorted(set(computed)) and computed[-1] < PROMPT_TOKENS, computed
        for n, layers in record["chunks"]:
            held = PLAN.kept_length_at(n)  # what the scheduler left blocks for: I <= held < I + bs
            assert PLAN.chunk_budget <= held < PLAN.chunk_budget + BLOCK_SIZE
            for positions, counts in layers:  # [H, M] held positions (-1 padded), [H]
                assert counts.tolist() == [held] * len(counts), (record["req_id"], n)
                assert int(positions.max()) < n, (record["req_id"], n)


def test_a_request_alone_answers_the_same_before_and_after_the_storm(storm):
    assert storm["probe_after"] == storm["probe_before"]


def test_a_client_giving_up_mid_prefill_leaves_no_block_and_no_worker_state(chunked_server, storm, tokenizer):
    """A 1000-token prompt takes eight 128-token steps. A 256-token prompt (two steps, evicted after the
    second) is timed alone, twice, and the 1000-token prompt is sent by a client that hangs up after the
    faster of the two: about two steps in (a decode step and the HTTP round trip more), around its first
    chunk eviction and some five steps before its prefill ends, so vLLM aborts it mid-prefill. (Timing the
    long prompt itself and hanging up at half of it failed once in CI: a second prompt of the same length
    finished within half the first one's time; hanging up at 1.5 times the short prompt's time failed once
    on a loaded 2-core machine, 2026-12-07: the long prompt ran that much faster than the probes.)"""
    two_steps_s = min(
        _seconds_to_answer(chunked_server, long_ids(tokenizer, 2 * CHUNK_TOKENS, seed)) for seed in (401, 402)
    )
    client = client_of(chunked_server, timeout_s=two_steps_s)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(
            model=chunked_server.served_model_name, prompt=long_ids(tokenizer, 1000, seed=400), max_tokens=1,
            temperature=0,
        )
    assert wait_for_usage_zero(chunked_server) == 0
    assert wait_for_worker_state_empty(chunked_server) == 0


def _seconds_to_answer(server: VLLMServer, prompt: list[int]) -> float:
    """Wall seconds of one greedy token on ``prompt``, sent alone."""
    started = time.monotonic()
    greedy_ids(server, prompt, 1)
    return time.monotonic() - started


def test_after_the_storm_no_block_and_no_worker_state_is_left_behind(chunked_server, storm):
    assert wait_for_usage_zero(chunked_server) == 0
    assert wait_for_worker_state_empty(chunked_server) == 0
