"""(d)/(e) ``vllm bench serve`` (vLLM's own client) against vanilla and ada-snapkv on the same KV pool.

    python3 -m benchmarks.gpu.bench_serve MODEL_DIR OUT_DIR [--graphs] [--input-len 4096] ...

Random prompts at request rate inf; the pool (``--num-gpu-blocks-override``) is small enough that vanilla
is KV-bound: ``num_gpu_blocks * 16`` tokens hold only a few ``input_len + output_len`` requests. One eviction
server serves every budget: the server's is 25 %, the others go per request (``--extra-body`` with
``vllm_xargs.kv_budget``). While each run lasts, ``/metrics`` is polled for the most running requests.
``--graphs`` runs every server with piecewise CUDA graphs instead of eager mode (stage e).
``--prefix-len P`` runs issue 30's shared-prefix workload instead: ``--dataset-name prefix_repetition``, one
P-token prefix shared by every request, ``--suffix-len`` tokens of each request's own, with each run's
prefix-cache hit tokens and prompt tokens computed from the server's counters; only the first budget runs
(a second run on the same server would find the first's prompts cached), and the two warm-up requests put
the prefix in each server's cache before the measured run. Results:
``OUT_DIR/bench[-graphs|-prefix].json`` and ``.md``, each run's ``vllm bench serve`` JSON beside them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks.gpu import serve_flags
from benchmarks.gpu.servers import BundleServer, start_all
from benchmarks.prefix_repetition import HITS, PROMPT_TOKENS, counter
from vllm_kvevict.bench.metrics_poller import MetricsPoller

#: vllm bench serve's result keys the table reports.
REPORTED = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
            "completed", "duration")


def dataset_args(args: argparse.Namespace) -> list[str]:
    """``vllm bench serve``'s dataset flags: random prompts, or one shared prefix (``--prefix-len``)."""
    if args.prefix_len:
        return ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-num-prefixes", "1",
                "--prefix-repetition-output-len", str(args.output_len)]
    return ["--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", str(args.range_ratio)]


def bench_command(server: BundleServer, model_dir: Path, args: argparse.Namespace, result: Path,
                  budget: str | None) -> list[str]:
    xargs = None if budget is None else {"kv_budget": float(budget)}
    return client_command(server, model_dir, dataset_args(args), args.num_prompts, result, xargs)


def client_command(server: BundleServer, model_dir: Path, dataset: list[str], num_prompts: int, result: Path,
                   xargs: dict | None) -> list[str]:
    """``vllm bench serve`` against ``server``: ``dataset``'s flags, rate inf, the result JSON to ``result``;
    ``xargs`` go with every request (``vllm_xargs``: a per-request budget or method)."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
        "--base-url", server.root_url, "--endpoint", "/v1/completions", "--model", server.served_model_name,
        "--tokenizer", str(model_dir), *dataset,
        "--num-prompts", str(num_prompts), "--request-rate", "inf", "--ignore-eos", "--seed", "0",
        "--num-warmups", "2", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result.parent),
        "--result-filename", result.name,
    ]
    if xargs:
        command += ["--extra-body", json.dumps({"vllm_xargs": xargs})]
    return command


def measure(server: BundleServer, command: list[str], result: Path, timeout_s: float) -> dict:
    """Run one ``vllm bench serve`` ``command`` (its JSON to ``result``, its output to ``result``'s ``.log``)
    while polling the server's ``/metrics``: the reported keys and the peaks, or ``{"error": ...}``."""
    with MetricsPoller(f"{server.root_url}/metrics", interval_s=0.25) as poller:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    result.with_suffix(".log").write_text(" ".join(command) + "\n" + completed.stdout + completed.stderr)
    if completed.returncode != 0:
        return {"error": f"vllm bench serve exited {completed.returncode}"}
    data = json.loads(result.read_text())
    row = {key: data.get(key) for key in REPORTED}
    row.update(max_running=poller.peaks.max_running, mean_running=round(poller.peaks.mean_running, 2),
               max_kv_usage=poller.peaks.max_kv_usage, preemptions=poller.peaks.preemptions)
    return row


def run_one(label: str, server: BundleServer, model_dir: Path, args: argparse.Namespace, out: Path,
            budget: str | None) -> dict:
    result = out / f"bench-{label}.json"
    command = bench_command(server, model_dir, args, result, budget)
    before = prefix_counters(server) if args.prefix_len else {}
    row = {"label": label, **measure(server, command, result, args.run_timeout_s)}
    if args.prefix_len and "error" not in row:
        after = prefix_counters(server)
        row["prefix_hit_tokens"] = after[HITS] - before[HITS]
        prompt_tokens = after[PROMPT_TOKENS] - before[PROMPT_TOKENS]
        row["prompt_tokens_computed"] = prompt_tokens - row["prefix_hit_tokens"]
    return row


def prefix_counters(server: BundleServer) -> dict[str, float]:
    """The server's prefix-cache hit and prompt token counters now (``prefix_repetition.counter``)."""
    return {name: counter(server, name) for name in (HITS, PROMPT_TOKENS)}


def ratios(rows: list[dict]) -> list[dict]:
    """Each eviction row against vanilla: output tok/s, running, TTFT p50, TPOT p50."""
    base = rows[0]
    out = []
    for row in rows[1:]:
        if "error" in row or "error" in base:
            continue
        out.append(ratios_against(row, base))
    return out


def ratios_against(row: dict, base: dict) -> dict:
    """``row``'s output tok/s, requests running at once, TTFT and TPOT medians as ratios to ``base``'s."""
    return {
        "label": row["label"],
        "output_tok_s": row["output_throughput"] / base["output_throughput"],
        "max_running": row["max_running"] / max(base["max_running"], 1),
        "ttft_p50": row["median_ttft_ms"] / base["median_ttft_ms"],
        "tpot_p50": row["median_tpot_ms"] / base["median_tpot_ms"],
    }


def markdown(result: dict) -> str:
    columns = ("label", *REPORTED, "max_running", "mean_running", "max_kv_usage", "preemptions")
    if any("prefix_hit_tokens" in row for row in result["rows"]):
        columns = (*columns, "prefix_hit_tokens", "prompt_tokens_computed")
    lines = [f"`{result['workload']}`", "", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    for row in result["rows"]:
        lines.append("| " + " | ".join(str(row.get(c, row.get("error", ""))) for c in columns) + " |")
    lines += ["", "| vs vanilla | output tok/s | max running | TTFT p50 | TPOT p50 |",
              "|---|---|---|---|---|"]
    for r in result["ratios"]:
        lines.append(f"| {r['label']} | {r['output_tok_s']:.2f}x | {r['max_running']:.2f}x | "
                     f"{r['ttft_p50']:.2f}x | {r['tpot_p50']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--graphs", action="store_true", help="piecewise CUDA graphs (stage e)")
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="lengths drawn in [len*(1-r), len*(1+r)]: 0.5 gives outputs of 128-384")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=2400,
                        help="KV pool of both servers in 16-token blocks (2400: ~8 vanilla requests of 4.3k)")
    parser.add_argument("--budgets", default="0.25,0.1",
                        help="the method's budgets (the first is the server's)")
    parser.add_argument("--method", default="ada-snapkv", help="the eviction server's --kv-eviction")
    parser.add_argument("--kv-cache-dtype", default=None, help="both servers' --kv-cache-dtype (e.g. fp8)")
    parser.add_argument("--tag", default=None,
                        help="suffix of this run's files (default: -prefix, -graphs or none by the workload)")
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="issue 30's workload: prefix_repetition with one prefix of this many tokens")
    parser.add_argument("--suffix-len", type=int, default=400, help="each request's own tokens after it")
    parser.add_argument("--run-timeout-s", type=float, default=150.0)
    parser.add_argument("--dry-run", action="store_true",
                        help="write the command lines to OUT/commands-bench*.json; start nothing")
    args = parser.parse_args(argv)
    if args.prefix_len and args.graphs:
        parser.error("--prefix-len runs eager servers; it does not combine with --graphs")
    suffix = "-prefix" if args.prefix_len else "-graphs" if args.graphs else ""
    suffix = suffix if args.tag is None else args.tag
    method, dtype = args.method, args.kv_cache_dtype
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    max_len = int(args.input_len * (1 + args.range_ratio) + args.output_len * (1 + args.range_ratio)) + 16
    if args.prefix_len:
        max_len = args.prefix_len + args.suffix_len + args.output_len + 16
    pool = serve_flags.pool_args(args.num_gpu_blocks)
    budgets = args.budgets.split(",")
    if args.prefix_len:
        budgets = budgets[:1]
    vanilla_flags = serve_flags.vanilla_args(max_len, args.graphs, kv_cache_dtype=dtype)
    eviction_flags = serve_flags.eviction_args(max_len, method=method, budget=budgets[0], graphs=args.graphs,
                                               kv_cache_dtype=dtype)
    vanilla = BundleServer(args.model_dir, [*vanilla_flags, *pool], logs / f"bench{suffix}-vanilla.log")
    eviction = BundleServer(args.model_dir, [*eviction_flags, *pool], logs / f"bench{suffix}-eviction.log")
    workload = (f"vllm bench serve {' '.join(dataset_args(args))} "
                f"--num-prompts {args.num_prompts} --request-rate inf; pool {args.num_gpu_blocks} blocks x "
                f"{serve_flags.BLOCK_SIZE}; {'piecewise CUDA graphs' if args.graphs else 'eager'}"
                f"{f'; --kv-cache-dtype {dtype}' if dtype else ''}")
    if args.dry_run:
        clients = {f"{method}-{b}": bench_command(eviction, args.model_dir, args, args.out / "x.json",
                                                    None if i == 0 else b) for i, b in enumerate(budgets)}
        clients["vanilla"] = bench_command(vanilla, args.model_dir, args, args.out / "x.json", None)
        commands = {"servers": {"vanilla": vanilla.command, "eviction": eviction.command}, "clients": clients}
        (args.out / f"commands-bench{suffix}.json").write_text(json.dumps(commands, indent=1) + "\n")
        return 0
    result: dict = {"workload": workload, "rows": [], "ratios": []}
    started = time.monotonic()
    try:
        with ExitStack() as stack:
            start_all(stack, [vanilla, eviction])
            result["startup_s"] = round(time.monotonic() - started, 1)
            result["rows"].append(run_one(f"vanilla{suffix}", vanilla, args.model_dir, args, args.out, None))
            for i, budget in enumerate(budgets):
                result["rows"].append(run_one(f"{method}-{budget}{suffix}", eviction, args.model_dir, args,
                                              args.out, None if i == 0 else budget))
    except Exception as error:  # noqa: BLE001 - recorded with what ran
        result["error"] = f"{type(error).__name__}: {error}"
    result["ratios"] = ratios(result["rows"]) if result["rows"] else []
    result["missing_c_ops"] = sorted(set(vanilla.missing_c_ops()) | set(eviction.missing_c_ops()))
    (args.out / f"bench{suffix}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (args.out / f"bench{suffix}.md").write_text(markdown(result))
    print(markdown(result))
    ok = "error" not in result and all("error" not in row for row in result["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
