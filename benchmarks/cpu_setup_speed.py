"""Prompt tok/s and TPOT of one vanilla server per CPU set-up (issue 11, item 6).

One ~2k-token prompt, 64 output tokens (ignore_eos), streamed, ``--repeats`` times per server after a
warm-up request; the median is printed as a markdown row. Set-ups: ``before`` (vLLM's defaults: the model's
bf16 on any x86 CPU, glibc malloc), ``after`` (``vllm_kvevict.cpu_setup``: dtype from the CPU, tcmalloc when
present) and ``float32`` (after, with float32 forced: shows whether bf16 is the right choice here).

    .venv/bin/python benchmarks/cpu_setup_speed.py [--setups before after float32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from vllm_kvevict.bench.client import run_workload
from vllm_kvevict.bench.workload import Workload, build_workload
from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.server_process import VLLMServer

SETUPS: dict[str, tuple[bool, tuple[str, ...]]] = {  # name -> (apply cpu_setup, extra args)
    "before": (False, ()),
    "after": (True, ()),
    "float32": (True, ("--dtype", "float32")),
}


def measure(name: str, workload: Workload, repeats: int) -> tuple[float, float]:
    """Median (prompt tok/s, TPOT ms) of ``repeats`` single-request runs on a fresh server."""
    apply_setup, extra = SETUPS[name]
    args = ("--max-model-len", "4096", "--no-enable-prefix-caching", *extra)
    with VLLMServer(prepared_model_dir(), extra_args=args, cpu_setup=apply_setup) as server:
        print(f"[{name}] {server.log_path}: {' '.join(server.command[2:])}", file=sys.stderr, flush=True)
        model = server.served_model_name
        run_workload(server.base_url, model, Workload(prompts=[workload.prompts[0][:64]], output_tokens=8), 1)
        prompt_rates, tpots = [], []
        for index in range(repeats):
            single = Workload(prompts=[workload.prompts[index]], output_tokens=workload.output_tokens)
            timing = run_workload(server.base_url, model, single, 1).requests[0]
            prompt_rates.append(len(workload.prompts[index]) / timing.ttft_s)
            tpots.append(1000 * (timing.latency_s - timing.ttft_s) / (timing.output_tokens - 1))
            print(f"[{name}] run {index}: {prompt_rates[-1]:.0f} prompt tok/s, TPOT {tpots[-1]:.1f} ms",
                  file=sys.stderr, flush=True)
    return statistics.median(prompt_rates), statistics.median(tpots)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--setups", nargs="+", choices=sorted(SETUPS), default=["before", "after", "float32"])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = prepared_model_dir()
    workload = build_workload(model_dir, args.repeats, args.prompt_tokens, args.output_tokens, seed=0)
    print("| set-up | prompt tok/s | TPOT ms | load average (1 min) after |\n|---|---:|---:|---:|")
    for name in args.setups:
        rate, tpot = measure(name, workload, args.repeats)
        print(f"| {name} | {rate:.0f} | {tpot:.1f} | {os.getloadavg()[0]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
