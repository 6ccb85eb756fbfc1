"""Shared prefixes with eviction, measured with vLLM's own client: ``vllm bench serve --dataset-name
prefix_repetition`` against vanilla vLLM at its defaults and an eviction server, same KV pool, same run.

For each server (vanilla first: the baseline of every ratio), start ``vllm serve`` on the bundled model, then
for each workload (``--workload PREFIX:SUFFIX``, one shared prefix of PREFIX tokens, a random SUFFIX per
request) run ``vllm bench serve`` with every request sent at once while ``/metrics`` is polled, and read
vLLM's own prefix-cache counters before and after. Prints one markdown table per workload with ratios to
vanilla; ``--out`` saves every number as JSON.

``--rounds N`` (N > 1) starts both servers at once instead and runs the workloads N times, alternating
between the servers (vanilla first in the first round, the eviction server first in the second, and so on)
with the dataset seed ``--seed + round`` (a new shared prefix each round), so each round's ratio compares
runs a few seconds apart: on a machine whose speed drifts over minutes (a shared VM) that ratio is steadier
than the ratio of two servers run one after the other. The servers are idle while the other one serves. It
then prints the median and range of the per-round ratios. ``--servers vanilla,twin,eviction`` adds a second
vanilla server (``twin``; the rounds then rotate the order of the three): its ratios to vanilla show how far
two identical servers differ in the same rounds, the method's own spread. ``--pinned`` (with ``--rounds``)
binds each server's engine to its own share of this process's CPUs (``VLLM_CPU_OMP_THREADS_BIND``; one core
each for two servers on a 2-core machine) and runs each round on all servers at the same time.

    python -m benchmarks.prefix_repetition --workload 3000:400 --workload 2000:2000 --num-prompts 16 \
        --out docs/results/2026-11-27-prefix-caching/prefix_repetition.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_kvevict.bench.metrics_poller import MetricsPoller
from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.server_process import VLLMServer, startup_timeout_for, vllm_executable

HITS = "vllm:prefix_cache_hits"  # counters: their samples are ..._total
QUERIES = "vllm:prefix_cache_queries"
PROMPT_TOKENS = "vllm:prompt_tokens"
EVICTION_SECONDS = "vllm_kvevict_eviction_step_seconds_sum"  # by phase; absent on vanilla


@dataclass
class Run:
    """One workload on one server: vLLM's bench results and the server's own counters."""

    server: str
    workload: str
    completed: int
    duration_s: float
    output_tok_s: float
    request_s: float
    median_ttft_ms: float
    median_tpot_ms: float
    median_e2el_ms: float
    prefix_hit_tokens: float
    prefix_query_tokens: float
    prompt_tokens_computed: float
    peak_kv_usage: float
    preemptions: float
    eviction_seconds: float  # the worker's eviction work (scoring, selection, moves) over the workload
    round: int = 0  # with --rounds: which round (dataset seed = --seed + round)
    peak_running: float = 0.0  # most requests running at once (vllm:num_requests_running, polled)


def counter(server: VLLMServer, name: str) -> float:
    """Sum of a counter family over its label sets (the ``_total`` sample)."""
    return sum(value for labels, value in server.metric_samples(name + "_total"))


def eviction_seconds(server: VLLMServer) -> float:
    samples = server.metric_samples(EVICTION_SECONDS)
    return sum(value for labels, value in samples if labels.get("phase") == "total")


def bench_workload(
    server: VLLMServer, label: str, prefix: int, suffix: int, args: argparse.Namespace, round_index: int = 0
) -> Run:
    """One ``vllm bench serve`` run of the workload on ``server`` (dataset seed: --seed + round_index)."""
    before = {name: counter(server, name) for name in (HITS, QUERIES, PROMPT_TOKENS)}
    evicting_before = eviction_seconds(server)
    with tempfile.TemporaryDirectory() as results_dir:
        command = [
            str(vllm_executable()),
            "bench",
            "serve",
            "--backend",
            "vllm",
            "--base-url",
            server.root_url,
            "--model",
            server.served_model_name,
            "--tokenizer",
            str(server.model_dir),
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(prefix),
            "--prefix-repetition-suffix-len",
            str(suffix),
            "--prefix-repetition-num-prefixes",
            "1",
            "--prefix-repetition-output-len",
            str(args.output_len),
            "--num-prompts",
            str(args.num_prompts),
            "--ignore-eos",
            "--seed",
            str(args.seed + round_index),
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            results_dir,
            "--result-filename",
            "result.json",
        ]
        if getattr(args, "extra_body", None):
            command += ["--extra-body", args.extra_body]
        print(
            f"[prefix-repetition] {label} {prefix}:{suffix}: {' '.join(command)}", file=sys.stderr, flush=True
        )
        with MetricsPoller(server.root_url + "/metrics") as poller:
            subprocess.run(command, check=True, stdout=sys.stderr)
        result = json.loads((Path(results_dir) / "result.json").read_text())
    after = {name: counter(server, name) for name in (HITS, QUERIES, PROMPT_TOKENS)}
    return Run(
        server=label,
        workload=f"{prefix}:{suffix}",
        completed=int(result["completed"]),
        duration_s=float(result["duration"]),
        output_tok_s=float(result["output_throughput"]),
        request_s=float(result["request_throughput"]),
        median_ttft_ms=float(result["median_ttft_ms"]),
        median_tpot_ms=float(result["median_tpot_ms"]),
        median_e2el_ms=float(result["median_e2el_ms"]),
        prefix_hit_tokens=after[HITS] - before[HITS],
        prefix_query_tokens=after[QUERIES] - before[QUERIES],
        prompt_tokens_computed=(after[PROMPT_TOKENS] - before[PROMPT_TOKENS]) - (after[HITS] - before[HITS]),
        peak_kv_usage=poller.peaks.max_kv_usage,
        preemptions=poller.peaks.preemptions,
        peak_running=poller.peaks.max_running,
        eviction_seconds=eviction_seconds(server) - evicting_before,
        round=round_index,
    )


def table(runs: list[Run]) -> str:
    """Markdown rows of one workload, each with its ratio to the first (vanilla)."""
    base = runs[0]

    def ratio(value: float, reference: float) -> str:
        return f"{value / reference:.2f}x" if reference else "-"

    lines = [
        f"workload {base.workload} (prefix:suffix tokens)",
        "",
        "| server | done | output tok/s | median TTFT ms | prefix hits | peak KV usage | peak running |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        lines.append(
            f"| {run.server} | {run.completed}"
            f" | {run.output_tok_s:.1f} ({ratio(run.output_tok_s, base.output_tok_s)})"
            f" | {run.median_ttft_ms:.0f} ({ratio(run.median_ttft_ms, base.median_ttft_ms)})"
            f" | {run.prefix_hit_tokens:.0f} ({ratio(run.prefix_hit_tokens, base.prefix_hit_tokens)})"
            f" | {run.peak_kv_usage:.3f} ({ratio(run.peak_kv_usage, base.peak_kv_usage)})"
            f" | {run.peak_running:.0f} ({ratio(run.peak_running, base.peak_running)}) |"
        )
    return "\n".join(lines)


def by_server(runs: Iterable[Run]) -> list[Run]:
    """``runs`` with vanilla's first (the baseline of every ratio), whichever ran first."""
    return sorted(runs, key=lambda run: run.server != "vanilla")


def ratio_summary(runs: list[Run], workload: str) -> str:
    """Median and range over rounds of each other server's output tok/s and duration against vanilla's in
    the same round (a line per server)."""
    rounds: dict[int, dict[str, Run]] = {}
    for run in runs:
        if run.workload == workload:
            rounds.setdefault(run.round, {})[run.server] = run
    others = list(dict.fromkeys(run.server for run in runs if run.server != "vanilla"))
    lines = []
    for other in others:
        throughput, seconds = [], []
        for index in sorted(rounds):
            vanilla, compared = rounds[index]["vanilla"], rounds[index][other]
            throughput.append(compared.output_tok_s / vanilla.output_tok_s)
            seconds.append(f"{vanilla.duration_s:.1f}/{compared.duration_s:.1f}")
        label, name = ("", "eviction") if len(others) == 1 else (f" ({other})", other)
        lines.append(
            f"workload {workload}{label}: output tok/s ratio over {len(rounds)} rounds: median "
            f"{statistics.median(throughput):.2f}x, min {min(throughput):.2f}x, max {max(throughput):.2f}x "
            f"(per round {', '.join(f'{x:.2f}' for x in throughput)}; vanilla/{name} s {', '.join(seconds)})"
        )
    return "\n".join(lines)


def rotated(live: list, index: int) -> list:
    """The order the servers serve round ``index`` in: each round starts one server later (two servers:
    vanilla first in even rounds, the other first in odd ones)."""
    shift = index % len(live)
    return live[shift:] + live[:shift]


#: vLLM's CPU worker binds its OpenMP threads to these CPUs ("0-3", "1", "0,2")
BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_shares(count: int) -> list[str]:
    """``count`` disjoint equal shares of this process's CPUs as ``VLLM_CPU_OMP_THREADS_BIND`` values."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        raise SystemExit(f"--pinned needs at least {count} CPUs for {count} servers; here: {len(cpus)}")
    share = len(cpus) // count
    return [",".join(map(str, cpus[i * share : (i + 1) * share])) for i in range(count)]


def together(
    live: list[tuple[str, VLLMServer]], prefix: int, suffix: int, args: argparse.Namespace, index: int
) -> list[Run]:
    """One round of the workload on every server at the same time (``--pinned``)."""
    with ThreadPoolExecutor(len(live)) as pool:
        futures = [
            pool.submit(bench_workload, server, label, prefix, suffix, args, index) for label, server in live
        ]
        runs = [future.result() for future in futures]
    for run in runs:
        print(f"[prefix-repetition] {run}", file=sys.stderr, flush=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", action="append", default=None, help="PREFIX:SUFFIX tokens (repeatable)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--method", default="ada-snapkv")
    parser.add_argument("--budget", default="0.25")
    parser.add_argument("--eviction-config", default=None, help="the eviction server's --kv-eviction-config")
    parser.add_argument("--kv-cache-space-gib", type=float, default=1)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="--num-gpu-blocks-override of both")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager on both (default: compiled)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="> 1: servers at once, taking turns")
    parser.add_argument("--pinned", action="store_true", help="with --rounds: own CPUs each, together")
    parser.add_argument("--servers", default="vanilla,eviction", help="vanilla first, then twin, eviction")
    parser.add_argument("--extra-body", default=None, help="JSON added to every request (e.g. vllm_xargs)")
    parser.add_argument("--out", type=Path, default=None, help="save every number as JSON here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} is not valid; it must be >= 1")
    if args.pinned and args.rounds < 2:
        parser.error("--pinned runs the servers together in rounds: give --rounds >= 2")
    workloads = [tuple(int(x) for x in w.split(":")) for w in (args.workload or ["3000:400"])]
    longest = max(prefix + suffix for prefix, suffix in workloads)
    common = ["--max-model-len", str(longest + args.output_len + 64)]
    if args.num_kv_blocks is not None:
        common += ["--num-gpu-blocks-override", str(args.num_kv_blocks)]
    eviction = [*common, "--kv-eviction", args.method, "--kv-budget", args.budget]
    if args.eviction_config:
        eviction += ["--kv-eviction-config", args.eviction_config]
    choices = {  # what --servers names: vanilla at vLLM's defaults, a second one (twin), the eviction server
        "vanilla": ("vanilla", common),
        "twin": ("vanilla twin", common),
        "eviction": (f"{args.method} @ {args.budget} {args.eviction_config or ''}".strip(), eviction),
    }
    kinds = args.servers.split(",")
    if kinds[0] != "vanilla" or len(set(kinds)) != len(kinds) or not set(kinds) <= set(choices):
        parser.error(f"--servers {args.servers} is not valid: vanilla first, then twin and/or eviction")
    servers = [choices[kind] for kind in kinds]
    binds = cpu_shares(len(servers)) if args.pinned else [None] * len(servers)
    model_dir = prepared_model_dir()

    def started(label: str, extra: list[str], bind: str | None = None) -> VLLMServer:
        print(f"[prefix-repetition] {label}: vllm serve {model_dir} {' '.join(extra)}", file=sys.stderr)
        return VLLMServer(
            model_dir,
            extra_args=extra,
            env=None if bind is None else {BIND: bind},
            kv_cache_space_gib=args.kv_cache_space_gib,
            enforce_eager=args.eager,
            startup_timeout_s=startup_timeout_for(args.eager),
        )

    runs: list[Run] = []
    if args.rounds == 1:
        for label, extra in servers:
            with started(label, extra) as server:
                for prefix, suffix in workloads:
                    runs.append(bench_workload(server, label, prefix, suffix, args))
                    print(f"[prefix-repetition] {runs[-1]}", file=sys.stderr, flush=True)
    else:
        with ExitStack() as stack:
            live = [
                (label, stack.enter_context(started(label, extra, bind)))
                for (label, extra), bind in zip(servers, binds, strict=True)
            ]
            for index in range(args.rounds):
                for prefix, suffix in workloads:
                    if args.pinned:
                        runs += together(live, prefix, suffix, args, index)
                        continue
                    for label, server in rotated(live, index):
                        run = bench_workload(server, label, prefix, suffix, args, index)
                        runs.append(run)
                        print(f"[prefix-repetition] {run}", file=sys.stderr, flush=True)
    for index in range(args.rounds):
        for prefix, suffix in workloads:
            workload = f"{prefix}:{suffix}"
            print(table(by_server(run for run in runs if run.workload == workload and run.round == index)))
            print()
    if args.rounds > 1:
        for prefix, suffix in workloads:
            print(ratio_summary(runs, f"{prefix}:{suffix}"))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: str(v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"settings": settings, "runs": [asdict(r) for r in runs]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
