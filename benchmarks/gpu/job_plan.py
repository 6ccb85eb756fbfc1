"""Which stages of the GPU job run in which device call, each stage's time limit and its estimated time.

    python3 -m benchmarks.gpu.job_plan shell [--call N]   # bash assignments run_gpu_job.sh evaluates
    python3 -m benchmarks.gpu.job_plan show               # the calls, their stages and estimates

A session lent a GPU has about 15 minutes of device time, in calls of at most 10 minutes, the machine's start
included; so the job is split into ``CALLS``, one prepared command each (``CALL=N bash
benchmarks/gpu/run_gpu_job.sh``), in the order they matter: the first serves the correctness checks and the
bundled shape's bench, the second the two large shapes, the third the fp8, prefix and scorer stages (a later
session when the first two used the time). Limits are what ``timeout`` enforces; estimates are guesses for an
H100 (``estimate_bench_seconds`` for a shape's bench), never measured: no request was ever served on a GPU
here. Standard library only: the job reads this before anything is unpacked.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from benchmarks.gpu import shapes


@dataclass(frozen=True)
class Stage:
    limit_s: int
    estimate_s: int


#: Stages that run in every call (the rest needs them); ``unpack`` reuses a work folder unpacked from the
#: same bundle, so after the first call it costs seconds (``REUSED_UNPACK_S``).
ALWAYS = ("unpack", "shape configs")
REUSED_UNPACK_S = 2
#: Guesses for an H100, device seconds: a server pair's start (imports, Triton JIT, profile run) ~70 s.
STAGES = {
    "unpack": Stage(120, 25),
    "shape configs": Stage(30, 3),
    "preflight commands": Stage(60, 20),
    "preflight vanilla": Stage(120, 25),
    "preflight eviction": Stage(120, 45),
    "correctness weights": Stage(90, 15),
    "correctness": Stage(240, 150),
    "graphs": Stage(240, 180),
    "prefix": Stage(240, 120),
    "scorer": Stage(150, 110),
    "fp8": Stage(150, 110),
    "fp8 bench": Stage(200, 130),
}

#: Modelled H100 rates (guesses): dense bf16 prefill in eager mode, HBM read, a decode step's fixed cost
#: (kernel launches of an eager model, scheduler, sampler, the eviction bookkeeping).
PREFILL_FLOP_S = 2.5e14
HBM_BYTES_S = 2.0e12
STEP_OVERHEAD_S = 0.012
SERVER_START_S = 70.0
WARMUPS = 2


def estimate_bench_seconds(shape: shapes.Shape, prompt_lens: tuple[int, ...] = (8192, 16384),
                           output_len: int = 256, budgets: tuple[float, ...] = (0.25, 0.1),
                           kept_context_row: bool = False, waves: int = 4) -> float:
    """A shape's part of a bench stage (``bench_shapes``), its servers' start not counted: its dummy weights,
    then per prompt length a vanilla row and one per budget (plus the kept-context row), each its prefills
    (dense and attention FLOPs) and its decode steps (weights and KV read once a step), with the running
    requests the pool allows."""
    pool = shapes.pool_blocks(min(prompt_lens), output_len)
    total = 3 * shape.weight_bytes() / shapes.GIB
    row_budgets = (None, *budgets, *((budgets[0],) if kept_context_row else ()))
    for prompt_len in prompt_lens:
        held = shapes.vanilla_requests(pool, prompt_len, output_len)
        prompts = waves * held
        attention = 2 * shape.num_layers * shape.num_heads * shape.head_dim * prompt_len**2
        flops = 2 * shape.parameters() * prompt_len + attention
        for budget in row_budgets:
            total += (prompts + WARMUPS) * flops / PREFILL_FLOP_S
            kept = prompt_len if budget is None else budget * prompt_len
            running = min(prompts, held if budget is None
                          else math.floor(held * shapes.capacity_limit(prompt_len, output_len, budget)))
            read = shape.weight_bytes() + running * (kept + output_len / 2) * shape.kv_bytes_per_token()
            total += math.ceil(prompts / running) * output_len * (STEP_OVERHEAD_S + read / HBM_BYTES_S)
    return total


#: Shapes whose servers start together in one bench stage (their memory shares fit the GPU side by side:
#: ``bench_shapes`` refuses a group that does not); the 8B shape's two servers take most of an H100.
BENCH_GROUPS = (("smollm2-135m", "qwen2.5-1.5b"), ("llama-3.1-8b",))


def bench_stage(names: tuple[str, ...]) -> str:
    return "bench " + "+".join(names)


for _group in BENCH_GROUPS:
    _estimate = SERVER_START_S + sum(
        estimate_bench_seconds(shapes.SHAPES[n], kept_context_row=n == "smollm2-135m") for n in _group)
    STAGES[bench_stage(_group)] = Stage(max(120, int(1.5 * _estimate) // 10 * 10), int(_estimate))

#: The device calls, in the order they matter; each runs ``ALWAYS`` first.
CALLS = {
    # preflight vanilla runs in the dry run; on the GPU the eviction role's covers the platform, the imports,
    # every command line and the models on meta (its attention is a TritonAttentionImpl too)
    1: ("preflight commands", "preflight eviction", "correctness weights", "correctness",
        bench_stage(BENCH_GROUPS[0])),
    2: (bench_stage(BENCH_GROUPS[1]),),
    3: ("correctness weights", "scorer", "fp8", "fp8 bench", "prefix"),
}
#: The device tool's limit for one command; a call's stage limits stay under it with a margin.
CALL_LIMIT_S = 600
CALL_MARGIN_S = 20
#: Device time of a session: the machine's start is counted too.
SESSION_S = 15 * 60
MACHINE_START_S = 120


def call_stages(call: int) -> tuple[str, ...]:
    return (*ALWAYS, *CALLS[call])


def call_seconds(call: int, field: str = "estimate_s") -> int:
    """The call's stages' estimates (after the first call the work folder is reused) or limits."""
    total = sum(getattr(STAGES[name], field) for name in call_stages(call))
    if field == "estimate_s" and call != min(CALLS):
        total += REUSED_UNPACK_S - STAGES["unpack"].estimate_s
    return total


def shell(call: int | None) -> str:
    """Bash assignments: each stage's limit (``LIMIT[name]``), the bench stages' shape groups
    (``BENCH_GROUPS``, space-separated names); with ``call``, ``ONLY`` (an anchored regex of
    its stages) and ``DEADLINE_S`` (the sum of their limits, at most the device tool's limit less a margin:
    no stage starts past it and the last is cut to what is left)."""
    lines = ["declare -A LIMIT=(" + " ".join(f"[{name!r}]={stage.limit_s}" for name, stage in STAGES.items())
             + ")", "BENCH_GROUPS=(" + " ".join(f"'{' '.join(group)}'" for group in BENCH_GROUPS) + ")"]
    if call is not None:
        names = "|".join(name for name in CALLS[call])
        deadline = min(call_seconds(call, "limit_s"), CALL_LIMIT_S - CALL_MARGIN_S)
        lines += [f"ONLY='^({names.replace('+', '[+]')})$'", f"DEADLINE_S={deadline}"]
    return "\n".join(lines) + "\n"


def show() -> str:
    lines = ["| call | stages | estimate, s | limits, s |", "|---|---|---|---|"]
    for call in CALLS:
        reused = call != min(CALLS)
        seconds = {n: REUSED_UNPACK_S if reused and n == "unpack" else STAGES[n].estimate_s
                   for n in call_stages(call)}
        stages = ", ".join(f"{name} ({s})" for name, s in seconds.items())
        lines.append(f"| {call} | {stages} | {call_seconds(call)} | {call_seconds(call, 'limit_s')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    as_shell = commands.add_parser("shell")
    as_shell.add_argument("--call", type=int, choices=sorted(CALLS), default=None)
    commands.add_parser("show")
    args = parser.parse_args(argv)
    print(shell(args.call) if args.command == "shell" else show(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
