"""(a) With a budget that covers the prompt, the eviction server's greedy tokens equal vanilla vLLM's.

Both servers hold the same weights; each request asks the eviction server for a per-request budget larger
than its prompt (``vllm_xargs.kv_budget``), so eviction keeps everything and must change nothing: the
evicting backend's attention over whole per-head sub-blocks is the Triton attention vanilla runs.
"""

from __future__ import annotations

from benchmarks.gpu.completions import complete, random_prompt

PROMPT_LENGTHS = (17, 250, 700, 1500)
NEW_TOKENS = 64


def run(vanilla, eviction, vocab_size: int) -> dict:
    """Per prompt: whether the tokens are identical, the first differing step and the largest logprob gap."""
    rows = []
    for seed, length in enumerate(PROMPT_LENGTHS):
        prompt = random_prompt(length, vocab_size, seed)
        reference = complete(vanilla.base_url, vanilla.served_model_name, prompt, NEW_TOKENS)
        evicting = complete(eviction.base_url, eviction.served_model_name, prompt, NEW_TOKENS,
                            xargs={"kv_budget": 4 * length})
        pairs = zip(reference.tokens, evicting.tokens, strict=True)
        differs = [i for i, (a, b) in enumerate(pairs) if a != b]
        agreed = differs[0] if differs else len(reference.tokens)
        gaps = [abs(a - b) for a, b in zip(reference.logprobs[:agreed], evicting.logprobs[:agreed],
                                           strict=True)]
        rows.append({"prompt_tokens": length, "identical": not differs, "first_difference": agreed,
                     "max_logprob_gap_before_it": max(gaps, default=0.0)})
    return {"ok": all(row["identical"] for row in rows), "rows": rows}
