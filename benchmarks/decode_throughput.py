"""Decode speed of an evicting CPU server at 16 concurrent compacted requests: this tree vs an older one.

Each server (same model, flags, KV pool and prompts; one after the other in one invocation) gets a warm-up
request, then ``--num-prompts`` prompts at once (all of them compact: the budget is far below the prompt),
``--output-tokens`` each with ``ignore_eos``. Printed per server: the median TPOT over requests (time per
output token after the first, which includes the other requests' prefills that run in between), the
aggregate decode rate ``num_prompts / TPOT``, output tok/s over the whole run and its wall time.

The older tree runs from ``PYTHONPATH`` (``git archive <rev> vllm_kvevict | tar -x -C /tmp/old``):

    .venv/bin/python benchmarks/decode_throughput.py --old-tree /tmp/old [--rounds 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from vllm_kvevict.bench.client import run_workload
from vllm_kvevict.bench.workload import Workload, build_workload
from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.server_process import VLLMServer


def measure(label: str, old_tree: str | None, workload: Workload, args: argparse.Namespace) -> dict:
    server_args = (
        "--max-model-len",
        "4096",
        "--no-enable-prefix-caching",
        "--block-size",
        "32",
        "--kv-eviction",
        args.method,
        "--kv-budget",
        str(args.budget),
    )
    env = {"PYTHONPATH": old_tree} if old_tree else {}
    with VLLMServer(prepared_model_dir(), extra_args=server_args, env=env) as server:
        print(f"[{label}] {server.log_path}", file=sys.stderr, flush=True)
        model = server.served_model_name
        run_workload(server.base_url, model, Workload(prompts=[workload.prompts[0]], output_tokens=8), 1)
        run = run_workload(server.base_url, model, workload, len(workload.prompts))
    tpots = [request.tpot_ms for request in run.requests]
    tpot = statistics.median(tpots)
    return {
        "label": label,
        "tpot_ms": tpot,
        "decode_tok_s": len(workload.prompts) * 1000 / tpot,
        "output_tok_s": run.output_tokens / run.wall_s,
        "wall_s": run.wall_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--old-tree", required=True, help="directory holding an older vllm_kvevict package")
    parser.add_argument("--method", default="ada-snapkv")
    parser.add_argument("--budget", default="128")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="old/new pairs, alternating")
    args = parser.parse_args()
    workload = build_workload(prepared_model_dir(), args.num_prompts, args.prompt_tokens, args.output_tokens)
    rows = []
    for _ in range(args.rounds):
        for label, tree in (("old tree", args.old_tree), ("this tree", None)):
            rows.append(measure(label, tree, workload, args))
            print(rows[-1], file=sys.stderr, flush=True)
    print(
        f"{args.num_prompts} x {args.prompt_tokens}-token prompts, {args.output_tokens} output tokens, "
        f"{args.method} @ {args.budget}, block size 32"
    )
    print("| server | TPOT p50 ms | decode tok/s (16 / TPOT) | output tok/s (whole run) | wall s |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['label']} | {row['tpot_ms']:.1f} | {row['decode_tok_s']:.1f} | "
            f"{row['output_tok_s']:.1f} | {row['wall_s']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
