"""Per-chunk eviction through a real server equals HF attention that hides what the server evicted, chunk by
chunk.

``vllm serve --kv-eviction ada-snapkv --kv-budget 64`` with vLLM's chunked prefill at 256 tokens per step,
one server for both runs. Asked for ``"kv_prefill": "chunked"`` (``vllm_xargs``), an 1100-token prompt
arrives in five chunks and is evicted after four of them (down to the intermediate budget, then to Ada-KV's
ragged final budgets), while a short uncompacted request and another chunked one share its steps. The
worker's debug dump records what every (layer, KV head) held after each evicting chunk; HF transformers
(float32, ``hf_reference.chunked``) prefills the same prompt segment by segment with exactly those entries
hidden, then teacher-forces vLLM's tokens with the final kept sets. A full-cache HF run is the control: where
the two differ, vLLM must side with the chunk-wise masked run. The same checks run with ``"kv_prefill":
"whole"`` (the server's default): the prompt still arrives in five chunks (chunked prefill stays on), nothing
is evicted before the last, which then reads the whole prompt back from the cache and keeps the method's
budgets.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from reference_checks import assert_vllm_sides_with_the_eviction, logprob_gap, tokens_and_logprobs

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

PROMPT_TOKENS = 1100
NEW_TOKENS = 96
FIRST_STEPS = 16
#: I = 128 tokens per head for a request evicted per chunk, given as tokens (1.5 B' but at least 512 tokens
#: would evict this prompt after two chunks only); one eviction after the last chunk unless a request asks.
#: The prompts' own windows judge them (``question_echo: 0``): the echo after each chunk is
#: ``test_question_echo_server.py``'s, and this test's near-tie bounds were set on these kept sets.
SERVER_ARGS = (
    "--kv-eviction", "ada-snapkv", "--kv-budget", "64", "--block-size", "32",
    "--max-model-len", "2048", "--enable-chunked-prefill", "--max-num-batched-tokens", "256",
    "--no-enable-prefix-caching",
    "--kv-eviction-config", '{"prefill": "whole", "chunk_budget": 128, "question_echo": 0}',
)
PREFILL_MODES = ("chunked", "whole")
USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class Run:
    """tokens [T] / vllm_logprobs [T]: vLLM's greedy output; record: the worker's dump of the prompt;
    masked / full: [T, vocab] HF log-probabilities chunk-wise masked / with the full cache."""

    prefill: str
    tokens: torch.Tensor
    vllm_logprobs: torch.Tensor
    record: dict
    masked: torch.Tensor
    full: torch.Tensor
    usage_after: float

    def gap(self, logprobs: torch.Tensor) -> torch.Tensor:
        return logprob_gap(self.vllm_logprobs, self.tokens, logprobs)


def story_prompt(tokenizer, num_tokens: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    names = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank"]
    lines = ["Ledger of the harbour."]
    tail = "\nNow retell every entry of the ledger in order.\n"
    while len(tokenizer("\n".join(lines) + tail)["input_ids"]) < num_tokens:
        lines.append(f"Entry {len(lines)}: {rng.choice(names)} shipped {rng.randint(10, 99)} crates to pier "
                     f"{rng.randint(1, 9)}.")
    return tokenizer("\n".join(lines) + tail)["input_ids"]


def generate(server: VLLMServer, prompt_ids: list[int], xargs: dict, others: list[tuple[list[int], dict]]):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="unused", timeout=1800, max_retries=0)

    def complete(ids: list[int], max_tokens: int, extra: dict, delay_s: float = 0.0):
        time.sleep(delay_s)
        return client.completions.create(
            model=server.served_model_name, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra},
        )

    with ThreadPoolExecutor(max_workers=1 + len(others)) as pool:
        checked = pool.submit(complete, prompt_ids, NEW_TOKENS, {"vllm_xargs": xargs})
        side = [pool.submit(complete, ids, 32, extra, 1.0 + i) for i, (ids, extra) in enumerate(others)]
        result = checked.result()
        assert all(s.result().usage.completion_tokens == 32 for s in side)
    return tokens_and_logprobs(result.choices[0].logprobs)


def wait_for_zero_usage(server: VLLMServer, timeout_s: float = 60.0) -> float:
    return server.wait_for_metric(USAGE, 0.0, timeout_s)


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kept")


@pytest.fixture(scope="module")
def server(model_dir, dump_dir):
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, env={DEBUG_DUMP_ENV: str(dump_dir)}) as running:
        yield running


@pytest.fixture(scope="module", params=PREFILL_MODES)
def run(request, server, dump_dir, model_dir) -> Run:
    from vllm_kvevict.hf_reference.chunked import teacher_forced_after_chunks
    from vllm_kvevict.hf_reference.model import load_reference_model
    from vllm_kvevict.policies.base import KeptTokens

    model, tokenizer = load_reference_model(model_dir, dtype=torch.float32)
    prompt_ids = story_prompt(tokenizer, PROMPT_TOKENS, seed=5)
    xargs = {"kv_prefill": request.param}
    others = [(story_prompt(tokenizer, 60, seed=6), {"vllm_xargs": {"kv_eviction": "none"}}),
              (story_prompt(tokenizer, 700, seed=7), {"vllm_xargs": xargs})]
    dumped_before = set(dump_dir.glob("*.pt"))
    tokens, vllm_logprobs = generate(server, prompt_ids, xargs, others)
    usage_after = wait_for_zero_usage(server)
    records = [torch.load(path) for path in set(dump_dir.glob("*.pt")) - dumped_before]
    (record,) = [r for r in records if r["prompt_len"] == len(prompt_ids)]
    chunks = [(end, [KeptTokens(p, c) for p, c in held]) for end, held in record["chunks"]]
    final = [KeptTokens(i, c) for i, c in zip(record["indices"], record["counts"], strict=True)]
    everything = [KeptTokens.everything(k.counts.shape[0], len(prompt_ids)) for k in final]
    return Run(
        prefill=request.param,
        tokens=tokens,
        vllm_logprobs=vllm_logprobs,
        record=record,
        masked=teacher_forced_after_chunks(model, prompt_ids, chunks, final, tokens),
        full=teacher_forced_after_chunks(model, prompt_ids, [], everything, tokens),
        usage_after=usage_after,
    )


def test_the_prompt_was_evicted_after_three_chunks_or_once_after_the_last_then_to_ragged_budgets(run: Run):
    ends = [end for end, _ in run.record["chunks"]]
    if run.prefill == "whole":
        assert ends == []  # five chunks computed, nothing evicted before the last one
    else:
        assert len(ends) >= 3 and ends == sorted(ends) and ends[-1] < PROMPT_TOKENS, ends
    for _end, held in run.record["chunks"]:
        counts = torch.stack([c for _, c in held])
        assert bool((counts == counts[0, 0]).all()), "between chunks every head holds the same count"
    assert any(len(set(c.tolist())) > 1 for c in run.record["counts"]), "Ada-KV's final budgets are ragged"


def test_decoding_matches_hf_hiding_what_each_chunk_evicted(run: Run):
    assert len(run.tokens) == NEW_TOKENS
    gap = run.gap(run.masked)
    # 0.2: bf16 attention on vLLM's AMX kernels reached 0.1505 in one of two full-suite runs on a CPU with
    # AMX tiles (AVX-512 without AMX stayed below 0.15)
    assert float(gap[:FIRST_STEPS].max()) < 0.2, f"first steps |delta logprob| {gap[:FIRST_STEPS].tolist()}"
    assert float(gap.mean()) < 0.03 and float(gap.max()) < 0.6, f"mean {gap.mean():.4f} max {gap.max():.4f}"


def test_vllm_follows_the_chunkwise_reference_where_eviction_changes_the_output(run: Run):
    assert_vllm_sides_with_the_eviction(run.vllm_logprobs, run.tokens, run.masked, run.full, min_moved=5)


def test_every_block_is_back_after_the_traffic(run: Run):
    assert run.usage_after == 0.0
