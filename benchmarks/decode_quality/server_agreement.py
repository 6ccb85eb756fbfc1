"""Decode-time eviction through the server: how long a capped request's greedy output stays identical to
the full cache's, and ROUGE-L between the two over the whole output.

One real ``vllm serve`` per decode method (prompts kept whole after prefill: the prefill budget is above
them, so every eviction is the decode-time cap's). On each server, every prompt is sent once with its cache
kept whole (``vllm_xargs {"kv_eviction": "none"}``) and once per cap (``{"kv_decode_budget": cap}``), all at
once, greedy, ``ignore_eos``. The full-cache outputs of the first server are the reference; those of the
other servers against it are the noise floor (the same request in other batches, bf16).

    .venv/bin/python benchmarks/decode_quality/server_agreement.py \\
        --out docs/results/decode-quality/server_agreement.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers import AutoTokenizer

from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.evaluation.sequence_agreement import common_prefix_length, rouge_l_f1
from vllm_kvevict.server_process import VLLMServer

TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "a caravan crossing the desert to a city of glass",
    "a young baker who opens a shop in a mountain village",
    "two astronauts repairing their station after a storm",
    "a detective in a rainy harbour town",
    "a girl who teaches her dog to read the stars",
    "an old clockmaker and his apprentice",
    "a fishing family during the longest winter",
    "a robot gardener on an abandoned island",
    "a travelling orchestra lost in a forest",
    "a chess champion who loses her memory",
    "a pilot delivering mail over the mountains",
]


def prompt_ids(tokenizer, topic: str) -> list[int]:
    messages = [{"role": "user", "content": f"Write a very long story, chapter by chapter, about {topic}."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate(server: VLLMServer, ids: list[int], tokens: int, xargs: dict) -> list[int]:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="unused", timeout=3600, max_retries=0)
    result = client.completions.create(
        model=server.served_model_name,
        prompt=ids,
        max_tokens=tokens,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, "vllm_xargs": xargs},
    )
    return [int(token.removeprefix("token_id:")) for token in result.choices[0].logprobs.tokens]


def run_server(
    model_dir: Path, method: str, caps: list[int], prompts: list[list[int]], tokens: int, block: int
):
    """{"full": [outputs per prompt], cap: [...]} from one server running ``method`` while decoding."""
    args = (
        "--kv-eviction", "snapkv", "--kv-budget", "2048",
        "--kv-decode-eviction", method, "--kv-decode-budget", str(caps[0]),
        "--block-size", str(block), "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
        "--max-num-seqs", str(len(prompts) * (len(caps) + 1)),
    )  # fmt: skip
    jobs = [("full", i, {"kv_eviction": "none"}) for i in range(len(prompts))]
    jobs += [(cap, i, {"kv_decode_budget": cap}) for cap in caps for i in range(len(prompts))]
    with (
        VLLMServer(model_dir, extra_args=args, kv_cache_space_gib=4) as server,
        ThreadPoolExecutor(len(jobs)) as pool,
    ):
        futures = [
            (key, i, pool.submit(generate, server, prompts[i], tokens, xargs)) for key, i, xargs in jobs
        ]
        outputs: dict = {"full": [None] * len(prompts), **{cap: [None] * len(prompts) for cap in caps}}
        for key, i, future in futures:
            outputs[key][i] = future.result()
    return outputs


def agreement(candidates: list[list[int]], references: list[list[int]]) -> dict:
    prefixes = [common_prefix_length(c, r) for c, r in zip(candidates, references, strict=True)]
    rouge = [rouge_l_f1(c, r) for c, r in zip(candidates, references, strict=True)]
    return {
        "identical_prefix_mean": statistics.mean(prefixes),
        "identical_prefix_median": statistics.median(prefixes),
        "identical_prefix": prefixes,
        "rouge_l_mean": statistics.mean(rouge),
        "rouge_l": rouge,
    }


def format_row(row: dict) -> str:
    return (
        f"{row['method']:13s} cap {row['cap']}: identical prefix mean {row['identical_prefix_mean']:7.1f} "
        f"median {row['identical_prefix_median']:6.1f}, ROUGE-L {row['rouge_l_mean']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", nargs="+", default=["roco", "h2o", "streamingllm", "snapkv"])
    parser.add_argument("--caps", nargs="+", type=int, default=[256, 512])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=32)
    args = parser.parse_args()

    model_dir = prepared_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [prompt_ids(tokenizer, topic) for topic in TOPICS[: args.prompts]]
    if min(len(p) for p in prompts) < 16:
        raise SystemExit(f"prompts of {[len(p) for p in prompts]} tokens: the chat template was not applied")
    result: dict = {
        "machine": platform.processor() or platform.machine(),
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "output_tokens": args.tokens,
        "block_size": args.block_size,
        "rows": [],
    }
    reference = None
    for method in args.methods:
        started = time.monotonic()
        outputs = run_server(model_dir, method, args.caps, prompts, args.tokens, args.block_size)
        if reference is None:
            reference = outputs["full"]
        else:
            result["rows"].append(
                {"method": "full, 2nd server", "cap": None, **agreement(outputs["full"], reference)}
            )
            print(format_row(result["rows"][-1]), flush=True)
        for cap in args.caps:
            row = {"method": method, "cap": cap, **agreement(outputs[cap], reference)}
            result["rows"].append(row)
            print(format_row(row), flush=True)
        print(f"{method}: {time.monotonic() - started:.0f} s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
