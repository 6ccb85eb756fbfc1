"""Settings and helpers of the reliability tests: one ``vllm serve`` with eviction and a small KV pool.

Small enough to bound the suite on 2 cores: max_model_len 1024 and a pool of 40 blocks of 32 tokens
(1280 token slots; vLLM needs one max_model_len request to fit, 32 blocks). A 600-token prompt needs 19
blocks to be prefilled and about 4 once compacted to 64 tokens per KV head, then one block per 32 generated
tokens: the preemption storms decode 256 tokens (12 blocks a request), so that even four requests running at
once overflow the pool; with 192, four fit exactly, and one CI run admitted the requests too far apart to
preempt any.
"""

from __future__ import annotations

import random

from vllm_kvevict.bench.workload import prose
from vllm_kvevict.server_process import VLLMServer

MAX_MODEL_LEN = 1024
BLOCK_SIZE = 32
NUM_BLOCKS = 40
BUDGET = 64
SERVER_ARGS = (
    "--kv-eviction", "ada-snapkv", "--kv-budget", str(BUDGET),
    "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
)
#: the server's policy fails in every layer of prompts of exactly these lengths (policy_guard.py); no
#: other test sends a prompt of these lengths.
INJECTED_FAULTS = {"raise": 701, "wrong_counts": 702, "nan": 703}
USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
WORKER_STATE = "vllm_kvevict_worker_requests"


def long_text(tokenizer, num_tokens: int, seed: int) -> str:
    """Prose of exactly ``num_tokens`` tokens (decoded back from cut ids), longer than the budget."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tokenizer.encode(" " + prose(rng, 32), add_special_tokens=False)
    return tokenizer.decode(ids[:num_tokens])


def long_ids(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """Token ids of ``long_text`` cut to exactly ``num_tokens`` (the prompt is compacted: > BUDGET)."""
    rng = random.Random(seed)
    ids: list[int] = tokenizer.encode(f"Document {seed}.", add_special_tokens=False)
    while len(ids) < num_tokens:
        ids += tokenizer.encode(" " + prose(rng, 32), add_special_tokens=False)
    return ids[:num_tokens]


def wait_for_metric_zero(server: VLLMServer, metric: str, timeout_s: float) -> float:
    """Poll ``metric`` until it is 0 or ``timeout_s`` passes; returns the last value."""
    return server.wait_for_metric(metric, 0.0, timeout_s)


def wait_for_usage_zero(server: VLLMServer, timeout_s: float = 60.0) -> float:
    """Poll ``vllm:kv_cache_usage_perc`` until it is 0 (no block held); returns the last value."""
    return wait_for_metric_zero(server, USAGE, timeout_s)


def wait_for_worker_state_empty(server: VLLMServer, timeout_s: float = 30.0) -> float:
    """Poll ``vllm_kvevict_worker_requests`` (set after every runner step) until 0; returns the last value."""
    return wait_for_metric_zero(server, WORKER_STATE, timeout_s)
