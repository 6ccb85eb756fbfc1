"""Where a decode step's time goes: vanilla against a decode-capped server, sampled with py-spy.

Each server (eager, so the Python frames show; same flags otherwise) gets a warm-up request, then
``--num-prompts`` short prompts at once, ``--output-tokens`` each with ``ignore_eos``. ``--delay`` seconds in
(steady decode), py-spy samples the worker process for ``--duration`` seconds. Printed per server: TPOT p50,
output tok/s, and the share of the worker's samples inside each of ``FRAMES`` (inclusive: a frame counts
once per sample, wherever it sits in the stack).

Needs py-spy (``.venv/bin/pip install py-spy==0.4.0``; not a project dependency):

    .venv/bin/python benchmarks/decode_profile.py --capped-args "--kv-eviction roco --kv-budget 256"
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from vllm_kvevict.bench.client import run_workload
from vllm_kvevict.bench.workload import Workload, build_workload
from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.server_process import VLLMServer

#: (label, "function (file" prefix of a py-spy raw frame) of the parts of a step this profile separates.
FRAMES = (
    ("model forward", "_model_forward (vllm/v1/worker/gpu_model_runner.py"),
    ("linear layers (oneDNN)", "onednn_mm (vllm/_custom_ops.py"),
    ("attention layers", "unified_attention_with_output (vllm/model_executor/layers/attention/attention.py"),
    ("vLLM's CPU attention kernel", "cpu_attention_with_kv_cache (vllm/_custom_ops.py"),
    ("decode-time re-score, all of it", "rescore_layer (vllm_kvevict/datapath/step.py"),
    ("  the method's selection", "select (vllm_kvevict/datapath/decode_rescore.py"),
    ("  moving kept rows", "move (vllm_kvevict/vllm_adapter/backend_cpu.py"),
    ("head-as-sequence attention", "head_attention (vllm_kvevict/vllm_adapter/backend_cpu.py"),
    ("query ring", "record_queries (vllm_kvevict/datapath/step.py"),
    ("logits", "compute_logits (vllm/model_executor/models/llama.py"),
)


def worker_pid(server: VLLMServer) -> int:
    import psutil

    assert server.pid is not None
    children = psutil.Process(server.pid).children(recursive=True)
    return next(p.pid for p in children if "Worker" in p.name() or "Worker" in " ".join(p.cmdline()))


def frame_shares(raw: Path, frames: tuple[tuple[str, str], ...] = FRAMES) -> tuple[int, Counter[str]]:
    """(samples, samples per ``frames`` label) from py-spy's ``--format raw`` output."""
    total, shares = 0, Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        stack_frames = stack.split(";")
        for label, prefix in frames:
            if any(frame.startswith(prefix) for frame in stack_frames):
                shares[label] += int(count)
    return total, shares


def measure(label: str, server_args: tuple[str, ...], workload: Workload, args: argparse.Namespace) -> dict:
    raw = Path(tempfile.mkdtemp()) / f"{label}.txt"
    with VLLMServer(prepared_model_dir(), extra_args=server_args) as server:
        model = server.served_model_name
        run_workload(server.base_url, model, Workload(prompts=[workload.prompts[0]], output_tokens=8), 1)
        pid = worker_pid(server)

        def sample() -> None:
            time.sleep(args.delay)
            command = [args.py_spy, "record", "-p", str(pid), "-d", str(args.duration), "-r", "40"]
            subprocess.run(
                [*command, "-f", "raw", "-o", str(raw), "--nonblocking"], check=True, capture_output=True
            )

        sampler = threading.Thread(target=sample)
        sampler.start()
        run = run_workload(server.base_url, model, workload, len(workload.prompts))
        sampler.join()
    tpots = [request.tpot_ms for request in run.requests]
    total, shares = frame_shares(raw)
    return {
        "label": label,
        "tpot_ms": statistics.median(tpots),
        "output_tok_s": run.output_tokens / run.wall_s,
        "samples": total,
        "shares": {name: shares[name] / total for name, _ in FRAMES},
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--capped-args", default="--kv-eviction roco --kv-budget 256")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=700)
    parser.add_argument("--delay", type=float, default=25.0, help="seconds into the run before sampling")
    parser.add_argument("--duration", type=int, default=40, help="seconds py-spy samples")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    args = parser.parse_args()
    workload = build_workload(prepared_model_dir(), args.num_prompts, args.prompt_tokens, args.output_tokens)
    common = (
        "--enforce-eager",
        "--max-model-len",
        "4096",
        "--block-size",
        "32",
        "--no-enable-prefix-caching",
    )
    rows = [
        measure("vanilla", common, workload, args),
        measure("capped", (*common, *shlex.split(args.capped_args)), workload, args),
    ]
    print(
        f"{args.num_prompts} x {args.prompt_tokens}-token prompts, {args.output_tokens} output tokens, "
        "eager, "
        f"block size 32; capped: {args.capped_args}"
    )
    print("| | " + " | ".join(row["label"] for row in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    print("| TPOT p50 ms | " + " | ".join(f"{row['tpot_ms']:.1f}" for row in rows) + " |")
    print("| output tok/s | " + " | ".join(f"{row['output_tok_s']:.1f}" for row in rows) + " |")
    print("| worker samples | " + " | ".join(str(row["samples"]) for row in rows) + " |")
    for name, _ in FRAMES:
        print(f"| {name} | " + " | ".join(f"{100 * row['shares'][name]:.1f} %" for row in rows) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
