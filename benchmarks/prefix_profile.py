"""Where a shared-prefix run's time goes: vanilla against an eviction server, through one ``vllm bench serve
--dataset-name prefix_repetition`` run each (``prefix_repetition.py``).

Each server starts at vLLM's defaults (same KV pool) and runs the workload once. Reported per server, with
the difference (eviction minus vanilla): vLLM's bench results; the server's own counters (prompt tokens
computed, scheduler steps, the eviction work's seconds); vLLM's CPU attention kernel timed call by call
(``attention_timer/sitecustomize.py``, loaded into the server through ``PYTHONPATH``) per batch kind, with
its work units (query rows × context × query heads) and nanoseconds per unit; and, from py-spy sampling the
worker process from the first request to the last, the seconds of samples inside each of ``FRAMES``
(inclusive: a frame counts once per sample, wherever it sits in the stack; sampling, so ± a few tenths of a
second from run to run). ``--eager`` shows the model's own Python frames (linear layers); compiled runs
match ``prefix_repetition.py``'s timing. py-spy 0.4.0 sometimes writes no samples (it panicked when stopped
in two of three runs on 2026-11-28); the table then names the server whose frames are missing.

Needs py-spy (``.venv/bin/pip install py-spy==0.4.0``; not a project dependency):

    .venv/bin/python -m benchmarks.prefix_profile --workload 3000:400 --eager
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.decode_profile import frame_shares, worker_pid
from benchmarks.prefix_repetition import Run, bench_workload
from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.server_process import VLLMServer, startup_timeout_for

SAMPLES_PER_S = 50
STEPS = "vllm:iteration_tokens_total_count"  # one observation per scheduler step
#: (label, start of a py-spy raw frame "function (file") of the parts of a step this profile separates.
FRAMES = (
    ("worker step (execute_model)", "execute_model (vllm/v1/worker/gpu_model_runner.py"),
    ("linear layers (oneDNN, eager only)", "onednn_mm (vllm/_custom_ops.py"),
    ("attention layers, all of it", "unified_attention_with_output (vllm/model_executor/layers/attention/"),
    ("  eviction after attention", "after_attention (vllm_kvevict/datapath/step.py"),
    ("    reading held keys/values", "read_held (vllm_kvevict/datapath/chunk_eviction.py"),
    ("    the method's selection", "kept_or_newest (vllm_kvevict/datapath/kept_selection.py"),
    ("      window attention (scoring)", "window_attention (vllm_kvevict/policies/attention_scores.py"),
    ("    moving kept rows", "move (vllm_kvevict/vllm_adapter/backend_cpu.py"),
    ("sampling", "sample_tokens (vllm/v1/worker/gpu_model_runner.py"),
)


TIMER_DIR = Path(__file__).with_name("attention_timer")
TIMES_ENV = "KVEVICT_ATTENTION_TIMES"


@dataclass
class Profile:
    """One server's run: vLLM's bench results, scheduler steps, kernel times and py-spy seconds."""

    run: Run
    steps: float
    kernel: dict[str, list[float]]  # batch kind -> [calls, seconds, query rows, work units] in the run
    frames: dict[str, float] | None  # FRAMES label -> seconds of samples; None: py-spy wrote none
    sampled_s: float


def timer_env(times: Path) -> dict[str, str]:
    """The server's environment for the kernel timer (the timer's folder first on ``PYTHONPATH``)."""
    path = os.pathsep.join(p for p in (str(TIMER_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, TIMES_ENV: str(times)}


def kernel_totals(times: Path) -> dict[str, list[float]]:
    """The timer's running totals per batch kind (empty before the server's first attention call)."""
    return json.loads(times.read_text()) if times.exists() else {}


def profiled_run(
    server: VLLMServer, label: str, prefix: int, suffix: int, times: Path, args: argparse.Namespace
) -> Profile:
    """One workload run of ``server`` with its kernel times (file ``times``) and py-spy frames."""
    raw = Path(tempfile.mkdtemp()) / f"{label}.txt"
    command = [args.py_spy, "record", "-p", str(worker_pid(server)), "-r", str(SAMPLES_PER_S)]
    command += ["-f", "raw", "-o", str(raw), "--nonblocking", "-d", "3600"]
    steps_before = server.metric_value(STEPS)
    kernel_before = kernel_totals(times)
    sampler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches before the first request
    try:
        run = bench_workload(server, label, prefix, suffix, args)
    finally:
        sampler.send_signal(signal.SIGINT)  # py-spy writes what it sampled on Ctrl-C
        _, errors = sampler.communicate(timeout=60)
    frames, total = None, 0.0
    if raw.exists():
        total, shares = frame_shares(raw, FRAMES)
        frames = {name: shares[name] / SAMPLES_PER_S for name, _ in FRAMES}
    else:  # the bench results and kernel times still stand; say why the frames are missing
        why = errors.decode()[-300:]
        print(f"[prefix-profile] py-spy wrote no samples for {label}: {why}", file=sys.stderr)
    kernel = {
        kind: [now - before for now, before in zip(values, kernel_before.get(kind, [0] * 4), strict=True)]
        for kind, values in kernel_totals(times).items()
    }
    return Profile(
        run,
        server.metric_value(STEPS) - steps_before,
        {kind: values for kind, values in kernel.items() if values[0]},
        frames,
        total / SAMPLES_PER_S,
    )


def table(profiles: list[Profile]) -> str:
    """Markdown: bench results, counters, kernel times and py-spy seconds per server, and the difference."""
    base, other = profiles

    def row(name: str, a: float, b: float, digits: int = 2) -> str:
        return f"| {name} | {a:.{digits}f} | {b:.{digits}f} | {b - a:+.{digits}f} |"

    lines = [
        f"| | {base.run.server} | {other.run.server} | difference |",
        "|---|---:|---:|---:|",
        row("wall s (vllm bench serve)", base.run.duration_s, other.run.duration_s),
        f"| output tok/s | {base.run.output_tok_s:.1f} | {other.run.output_tok_s:.1f} | "
        f"{other.run.output_tok_s / base.run.output_tok_s:.3f}x |",
        row("prompt tokens computed", base.run.prompt_tokens_computed, other.run.prompt_tokens_computed, 0),
        row("scheduler steps", base.steps, other.steps, 0),
        row("eviction work s (server counter)", base.run.eviction_seconds, other.run.eviction_seconds),
    ]
    kinds = sorted(set(base.kernel) | set(other.kernel))
    for field, index, scale in (("s", 1, 1.0), ("work units, G", 3, 1e-9)):
        a = sum(values[index] for values in base.kernel.values()) * scale
        b = sum(values[index] for values in other.kernel.values()) * scale
        lines.append(row(f"attention kernel, all batches, {field}", a, b))
    for kind in kinds:
        a, b = base.kernel.get(kind, [0, 0.0, 0, 0]), other.kernel.get(kind, [0, 0.0, 0, 0])
        lines.append(row(f"  {kind}: s", a[1], b[1]))
        per_unit = [values[1] / values[3] * 1e9 if values[3] else 0.0 for values in (a, b)]
        lines.append(row(f"  {kind}: ns per work unit", *per_unit, 3))
    if base.frames is None or other.frames is None:
        missing = ", ".join(p.run.server for p in profiles if p.frames is None)
        lines.append(f"| py-spy frames | no samples from {missing} | | |")
        return "\n".join(lines)
    lines.append(row("worker samples (py-spy), s", base.sampled_s, other.sampled_s))
    for name, _ in FRAMES:
        lines.append(row(f"{name}, s", base.frames[name], other.frames[name]))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="3000:400", help="PREFIX:SUFFIX tokens")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--method", default="ada-snapkv")
    parser.add_argument("--budget", default="0.25")
    parser.add_argument("--kv-cache-space-gib", type=float, default=1)
    parser.add_argument("--eager", action="store_true", help="--enforce-eager on both (default: compiled)")
    parser.add_argument("--seed", type=int, default=0)
    beside_python = str(Path(sys.executable).with_name("py-spy"))
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or beside_python)
    args = parser.parse_args()
    args.extra_body = None
    prefix, suffix = (int(x) for x in args.workload.split(":"))
    common = ["--max-model-len", str(prefix + suffix + args.output_len + 64)]
    servers = [
        ("vanilla", common),
        (
            f"{args.method} @ {args.budget}",
            [*common, "--kv-eviction", args.method, "--kv-budget", args.budget],
        ),
    ]
    profiles = []
    for label, extra in servers:
        times = Path(tempfile.mkdtemp()) / "attention_times.json"
        with VLLMServer(
            prepared_model_dir(),
            extra_args=extra,
            env=timer_env(times),
            kv_cache_space_gib=args.kv_cache_space_gib,
            enforce_eager=args.eager,
            startup_timeout_s=startup_timeout_for(args.eager),
        ) as server:
            profiles.append(profiled_run(server, label, prefix, suffix, times, args))
    mode = "eager" if args.eager else "compiled"
    print(
        f"prefix_repetition {args.workload}, {args.num_prompts} prompts, {args.output_len} output tokens, "
        f"{mode}"
    )
    print(table(profiles))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
