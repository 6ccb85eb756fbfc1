"""One request's end-to-end time through a real eviction server, for two source trees in one run.

For each tree (a directory holding ``vllm_kvevict/``, put first on ``PYTHONPATH`` so the plugin entry point
loads it), start ``vllm serve`` on the bundled model with ``--kv-eviction METHOD --kv-budget B``, send one
warm-up request, then time ``--repeats`` requests of a distinct ``--prompt-tokens`` prompt each (greedy,
``--output-tokens`` tokens): wall time from send to last token, and time to first token (streamed). Trees
alternate in ``--rounds`` rounds so both see the same machine load. Prints one markdown table with ratios to
the first tree.

    python benchmarks/tree_latency.py --trees /tmp/before,. --labels before,after
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from openai import OpenAI

from vllm_kvevict.bench.workload import build_workload
from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.server_process import VLLMServer


def time_requests(
    server: VLLMServer, prompts: list[list[int]], output_tokens: int
) -> list[tuple[float, float]]:
    """(seconds to the first token, seconds to the last) of each prompt, sent one at a time."""
    client = OpenAI(base_url=server.base_url, api_key="unused")
    timings = []
    for prompt in prompts:
        started = time.perf_counter()
        first = None
        stream = client.completions.create(
            model=server.served_model_name, prompt=prompt, max_tokens=output_tokens, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True},
        )
        for _ in stream:
            first = first or time.perf_counter() - started
        timings.append((first or 0.0, time.perf_counter() - started))
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", required=True, help="comma-separated source trees")
    parser.add_argument("--labels", required=True, help="comma-separated labels, one per tree")
    parser.add_argument("--method", default="ada-snapkv")
    parser.add_argument("--budget", default="0.25")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    labels = args.labels.split(",")
    model_dir = prepared_model_dir()
    workload = build_workload(model_dir, 1 + args.repeats, args.prompt_tokens, args.output_tokens)
    results: dict[str, list[tuple[float, float]]] = {label: [] for label in labels}
    for _ in range(args.rounds):
        for tree, label in zip(trees, labels, strict=True):
            flags = ["--kv-eviction", args.method, "--kv-budget", args.budget, "--max-model-len", "8192"]
            with VLLMServer(model_dir, flags, env={"PYTHONPATH": tree}, kv_cache_space_gib=2) as server:
                time_requests(server, workload.prompts[:1], args.output_tokens)  # warm-up
                results[label] += time_requests(server, workload.prompts[1:], args.output_tokens)
    base = statistics.median(t for _, t in results[labels[0]])
    print(f"| tree | requests | TTFT median s | end-to-end median s | ratio to {labels[0]} |")
    print("|---|---:|---:|---:|---:|")
    for label in labels:
        ttft = statistics.median(f for f, _ in results[label])
        total = statistics.median(t for _, t in results[label])
        print(f"| {label} | {len(results[label])} | {ttft:.2f} | {total:.2f} | {total / base:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
