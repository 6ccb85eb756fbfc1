"""The workload through vLLM's own client instead (``--client vllm``): ``vllm bench serve`` with random
prompts of exactly ``--prompt-tokens`` tokens (range ratio 0), ``--output-tokens`` each with ``ignore_eos``,
request rate inf; its detailed result becomes the same per-request timings the report reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vllm_kvevict.bench.client import RequestTiming, RunTiming


def bench_serve_command(
    root_url: str,
    model: str,
    tokenizer: Path,
    num_prompts: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int,
    result: Path,
    concurrency: int | None = None,
) -> list[str]:
    """``vllm bench serve`` of the workload, its per-request results (``--save-detailed``) to ``result``."""
    from vllm_kvevict.server_process import vllm_executable

    command = [
        str(vllm_executable()), "bench", "serve", "--backend", "vllm", "--base-url", root_url,
        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(prompt_tokens),
        "--random-output-len", str(output_tokens), "--random-range-ratio", "0",
        "--num-prompts", str(num_prompts), "--request-rate", "inf", "--ignore-eos", "--seed", str(seed),
        "--disable-tqdm", "--save-result", "--save-detailed",
        "--result-dir", str(result.parent), "--result-filename", result.name,
    ]  # fmt: skip
    if concurrency is not None:
        command += ["--max-concurrency", str(concurrency)]
    return command


def timing_from_result(data: dict) -> RunTiming:
    """Per-request TTFT, latency and token counts of a ``--save-detailed`` result; wall time is vLLM's
    ``duration`` (first request sent to last finished). A failed request is an error: a capacity run that
    lost requests is not a measurement."""
    failed = [error for error in data.get("errors", []) if error]
    if failed or data.get("failed"):
        raise RuntimeError(f"vllm bench serve: {len(failed)} requests failed, first: {failed[:1]}")
    requests = [
        RequestTiming(ttft_s=ttft, latency_s=latency, output_tokens=out, prompt_tokens=prompt)
        for ttft, latency, out, prompt in zip(
            data["ttfts"], data["latencies"], data["output_lens"], data["input_lens"], strict=True
        )
    ]
    return RunTiming(requests=requests, wall_s=float(data["duration"]))


def run_bench_serve(command: list[str], result: Path) -> RunTiming:
    """Run ``command`` (from :func:`bench_serve_command`, its output to stderr) and read ``result``."""
    print(f"[bench] {' '.join(command)}", file=sys.stderr, flush=True)
    completed = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.STDOUT)
    if completed.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited {completed.returncode}")
    return timing_from_result(json.loads(result.read_text()))
