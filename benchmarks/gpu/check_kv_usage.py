"""(c) Blocks come back: the eviction server's KV-cache usage while decoding is at most 0.35x vanilla's at
25 % kept, for the same requests on the same pool.

Each server gets the same concurrent long requests; ``vllm:kv_cache_usage_perc`` is polled, and the peak
over polls during which only decoding happened (``MetricsPoller``'s ``max_kv_usage_decoding``) is compared.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from benchmarks.gpu.completions import complete, random_prompt
from vllm_kvevict.bench.metrics_poller import MetricsPoller

REQUESTS = 8
#: Kept entries plus generated tokens over prompt plus generated tokens: (750 + 160) / 3160 = 0.29 at the
#: end of decoding, under the 0.35 the issue asks for (512 new tokens on 2,000 would be 0.40 by arithmetic).
PROMPT_TOKENS = 3000
NEW_TOKENS = 160
MAX_RATIO = 0.35


def peak_decoding_usage(server, vocab_size: int) -> tuple[float, float]:
    """(peak KV usage while only decoding, peak KV usage) over :data:`REQUESTS` concurrent requests."""
    prompts = [random_prompt(PROMPT_TOKENS, vocab_size, 100 + i) for i in range(REQUESTS)]
    with MetricsPoller(f"{server.root_url}/metrics", interval_s=0.1) as poller:
        with ThreadPoolExecutor(REQUESTS) as pool:
            done = list(pool.map(lambda p: complete(server.base_url, server.served_model_name, p, NEW_TOKENS),
                                 prompts))
    assert all(len(c.tokens) == NEW_TOKENS for c in done)
    return poller.peaks.max_kv_usage_decoding, poller.peaks.max_kv_usage


def run(vanilla, eviction, vocab_size: int) -> dict:
    vanilla_decoding, vanilla_peak = peak_decoding_usage(vanilla, vocab_size)
    eviction_decoding, eviction_peak = peak_decoding_usage(eviction, vocab_size)
    ratio = eviction_decoding / vanilla_decoding if vanilla_decoding else float("nan")
    return {"ok": ratio <= MAX_RATIO, "ratio": ratio, "max_ratio": MAX_RATIO,
            "vanilla_decoding": vanilla_decoding, "eviction_decoding": eviction_decoding,
            "vanilla_peak": vanilla_peak, "eviction_peak": eviction_peak,
            "requests": REQUESTS, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS}
