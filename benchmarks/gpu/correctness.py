"""Checks (a)-(c) of the GPU job against one vanilla and one eviction server started together.

    python3 -m benchmarks.gpu.correctness MODEL_DIR OUT_DIR [--checks greedy,reference,kv_usage]
        [--method kvzap] [--kv-cache-dtype fp8] [--tag=-kvzap]

``MODEL_DIR`` holds real weights (``random_weights``: the reference check needs HF to load what vLLM
serves). Both servers share the GPU, with the same KV pool. Each check runs under its own time limit;
results go to ``OUT_DIR/correctness{TAG}.json`` and ``correctness{TAG}.md``, server logs to ``OUT_DIR/logs``.
``--method`` names the eviction server's method (the learned scorer's stage: ``kvzap``, whose packaged scorer
matches the random checkpoint's config); ``--kv-cache-dtype`` quantises both servers' caches (the fp8 stage).
Exit status 0 when every check that ran passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import ExitStack
from pathlib import Path

from benchmarks.gpu import check_greedy, check_kv_usage, check_reference, serve_flags
from benchmarks.gpu.servers import BundleServer, start_all

NUM_GPU_BLOCKS = 4096
MAX_MODEL_LEN = 4096
CHECK_TIMEOUT_S = {"greedy": 60, "reference": 150, "kv_usage": 90}


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--checks", default=",".join(CHECK_TIMEOUT_S))
    parser.add_argument("--method", default="ada-snapkv", help="the eviction server's --kv-eviction")
    parser.add_argument("--kv-cache-dtype", default=None, help="both servers' --kv-cache-dtype (e.g. fp8)")
    parser.add_argument("--tag", default="", help="suffix of this run's files (e.g. -kvzap, -fp8)")
    parser.add_argument("--dry-run", action="store_true",
                        help="write the command lines to OUT/commands-correctness{TAG}.json; start nothing")
    args = parser.parse_args(argv)
    tag = args.tag
    checks = [c for c in args.checks.split(",") if c]
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    dump_dir = args.out / f"kept-sets{args.tag}"
    pool = serve_flags.pool_args(NUM_GPU_BLOCKS)
    dtype = args.kv_cache_dtype
    vanilla_flags = serve_flags.vanilla_args(MAX_MODEL_LEN, dummy_weights=False, kv_cache_dtype=dtype)
    eviction_flags = serve_flags.eviction_args(MAX_MODEL_LEN, method=args.method, dummy_weights=False,
                                               kv_cache_dtype=dtype)
    vanilla = BundleServer(args.model_dir, [*vanilla_flags, *pool], logs / f"correctness{tag}-vanilla.log")
    eviction = BundleServer(args.model_dir, [*eviction_flags, *pool], logs / f"correctness{tag}-eviction.log",
                            env={check_reference.DUMP_ENV: str(dump_dir)})
    if args.dry_run:
        commands = {"servers": {"vanilla": vanilla.command, "eviction": eviction.command}}
        (args.out / f"commands-correctness{tag}.json").write_text(json.dumps(commands, indent=1) + "\n")
        return 0
    vocab = vocab_size(args.model_dir)
    jobs = {
        "greedy": lambda: check_greedy.run(vanilla, eviction, vocab),
        "reference": lambda: check_reference.run(eviction, args.model_dir, dump_dir, vocab),
        "kv_usage": lambda: check_kv_usage.run(vanilla, eviction, vocab),
    }
    results: dict = {"servers": {"vanilla": vanilla.command, "eviction": eviction.command}}
    started = time.monotonic()
    # A check over its limit is abandoned: stopping the servers (closing the stack) ends its requests, and
    # the runner is not waited for.
    runner = ThreadPoolExecutor(1)
    try:
        with ExitStack() as stack:
            start_all(stack, [vanilla, eviction])
            results["startup_s"] = round(time.monotonic() - started, 1)
            for name in checks:
                began = time.monotonic()
                future = runner.submit(jobs[name])
                try:
                    results[name] = future.result(timeout=CHECK_TIMEOUT_S[name])
                except FutureTimeout:
                    results[name] = {"ok": False, "error": f"over {CHECK_TIMEOUT_S[name]} s"}
                    break  # its thread still uses the servers
                except Exception as error:  # noqa: BLE001 - recorded; the other checks still run
                    results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}",
                                     "traceback": traceback.format_exc(limit=-6)}
                results[name]["seconds"] = round(time.monotonic() - began, 1)
    except Exception as error:  # noqa: BLE001 - a server that did not start: its log tail is the result
        results["error"] = f"{type(error).__name__}: {error}"
    finally:
        runner.shutdown(wait=False, cancel_futures=True)
    results["missing_c_ops"] = sorted(set(vanilla.missing_c_ops()) | set(eviction.missing_c_ops()))
    ran = [results[name] for name in checks if name in results]
    results["ok"] = "error" not in results and len(ran) == len(checks) and all(r["ok"] for r in ran)
    (args.out / f"correctness{tag}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (args.out / f"correctness{tag}.md").write_text(markdown(results, checks))
    print(markdown(results, checks))
    return 0 if results["ok"] else 1


def markdown(results: dict, checks: list[str]) -> str:
    lines = ["| check | ok | result |", "|---|---|---|"]
    for name in checks:
        result = results.get(name, {"ok": False, "error": "not run"})
        shown = {k: v for k, v in result.items() if k not in ("ok", "traceback", "rows")}
        lines.append(f"| {name} | {result['ok']} | {json.dumps(shown, default=str)} |")
    if results.get("error"):
        lines.append(f"\nserver start failed: {results['error'][:2000]}")
    if results.get("missing_c_ops"):
        lines.append(f"\ntorch.ops._C names the stub lacks: {', '.join(results['missing_c_ops'])}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
