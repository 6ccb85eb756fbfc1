"""``vllm-kvevict soak``: N minutes of mixed traffic against a server with eviction, then what it left.

Starts ``vllm serve`` on 127.0.0.1 with eviction and a small KV pool (so that the pool, not the client,
is the limit and preemption happens), sends short, long, streaming, client-aborted and invalid requests from
``--concurrency`` clients until the time is up, waits for the last answers, and prints: requests served,
aborted, answered 4xx (expected for the invalid ones), 5xx (must be 0), transport errors, preemptions,
leaked blocks (``vllm:kv_cache_usage_perc`` once idle, must be 0), the worker's eviction state left
(``vllm_kvevict_worker_requests``, must be 0) and ``/health``. Exits 1 when any of those checks fails.

With ``--base-url http://127.0.0.1:PORT`` it soaks a server already running on this machine instead (the
server's flags are then its own; the reliability tests use this).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER_STATE = "vllm_kvevict_worker_requests"
USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "soak", help="Mixed traffic for N minutes against a server with eviction; prints what it left.",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--minutes", type=positive_float, required=True, help="minutes of traffic")
    add("--base-url", default=None,
        help="soak this running local server (e.g. http://127.0.0.1:8000) instead of starting one")
    add("--model-dir", type=Path, default=None, help="HF model directory (default: the bundled model)")
    add("--method", default="ada-snapkv", help="eviction method (default: ada-snapkv)")
    add("--budget", default="64", help="--kv-budget (default: 64 tokens per KV head)")
    add("--concurrency", type=positive_int, default=8, help="concurrent clients (default: 8)")
    add("--num-kv-blocks", type=positive_int, default=40,
        help="KV pool in blocks (--num-gpu-blocks-override, default 40: small enough to preempt)")
    add("--block-size", type=positive_int, default=32, help="block size in tokens (default: 32)")
    add("--max-model-len", type=positive_int, default=1024, help="context length (default: 1024)")
    add("--server-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    add("--seed", type=int, default=0, help="traffic seed (default: 0)")
    add("--append", type=Path, default=None, help="append the summary to this markdown file")
    add("--machine", default=None, help="machine description for --append (default: probed)")
    parser.set_defaults(handler=run)


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of minutes")
    return value


def server_args(args: argparse.Namespace) -> list[str]:
    return [
        "--kv-eviction", args.method, "--kv-budget", str(args.budget), "--block-size", str(args.block_size),
        "--num-gpu-blocks-override", str(args.num_kv_blocks), "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.concurrency), *args.server_arg,
    ]


@dataclass(frozen=True)
class AfterTraffic:
    """The server's state once the traffic stopped and the last answers came back."""

    usage: float
    leaked_blocks: int
    worker_requests: float | None  # None: the metric is not exposed
    preemptions: float
    health: int
    seconds_to_idle: float


def run(args: argparse.Namespace) -> int:
    from vllm_kvevict.cli.prepare_model import prepared_model_dir
    from vllm_kvevict.server_process import VLLMServer
    from vllm_kvevict.soak.probe import ServerProbe

    try:
        probe = ServerProbe(args.base_url) if args.base_url is not None else None
    except ValueError as error:
        print(f"vllm-kvevict soak: error: --base-url {error}", file=sys.stderr)
        return 2
    model_dir = args.model_dir or prepared_model_dir()
    prompts = build_prompts(model_dir, args)
    if probe is not None:
        counts, after, wall_s = soak(probe, prompts, args)
        alive = after.health == 200
    else:
        print(f"[soak] vllm serve {model_dir} {shlex.join(server_args(args))}", file=sys.stderr, flush=True)
        with VLLMServer(model_dir, extra_args=tuple(server_args(args))) as server:
            counts, after, wall_s = soak(ServerProbe(server.root_url), prompts, args)
            alive = server.is_running()
    report = summary(args, counts, after, wall_s, alive)
    print(report)
    if args.append is not None:
        append_summary(args, report)
    return 0 if passed(counts, after, alive) else 1


def soak(probe, prompts, args: argparse.Namespace):
    """Traffic until the deadline, then the server's state once idle: (counts, AfterTraffic, wall seconds)."""
    from vllm_kvevict.soak.traffic import TrafficRun

    start_preemptions = probe.metric_sum(PREEMPTIONS)
    started = time.monotonic()
    traffic = TrafficRun(probe.base_url, probe.served_model(), prompts, args.seed, 600)
    counts = traffic.run(args.concurrency, deadline=started + 60 * args.minutes)
    wall_s = time.monotonic() - started
    num_blocks = probe.num_kv_blocks() or args.num_kv_blocks
    return counts, observe_after_traffic(probe, num_blocks, start_preemptions), wall_s


def build_prompts(model_dir: Path, args: argparse.Namespace):
    """Long prompts (200 .. max_model_len - 160 tokens, compacted) and short ones (within the budget)."""
    import random

    from transformers import AutoTokenizer

    from vllm_kvevict.bench.workload import build_workload
    from vllm_kvevict.soak.traffic import Prompts

    rng = random.Random(args.seed)
    longest = args.max_model_len - 160
    workload = build_workload(model_dir, 24, longest, 1, seed=args.seed)
    long = [ids[: rng.randint(min(200, longest), longest)] for ids in workload.prompts]
    short = [ids[: rng.randint(1, 48)] for ids in workload.prompts]
    vocab_size = len(AutoTokenizer.from_pretrained(str(model_dir)))
    return Prompts(long=long, short=short, max_model_len=args.max_model_len, vocab_size=vocab_size)


def observe_after_traffic(probe, num_blocks: int, start_preemptions: float, timeout_s: float = 120):
    """Wait until no block is held (or ``timeout_s``), then read usage, worker state, preemptions, health."""
    started = time.monotonic()
    usage = probe.metric_sum(USAGE)
    while usage != 0 and time.monotonic() - started < timeout_s:
        time.sleep(0.5)
        usage = probe.metric_sum(USAGE)
    seconds_to_idle = time.monotonic() - started
    time.sleep(1.0)  # one more engine step publishes the worker's state after the last finish
    worker = probe.metric_samples(WORKER_STATE)
    return AfterTraffic(
        usage=usage,
        leaked_blocks=round(usage * num_blocks),
        worker_requests=sum(value for _, value in worker) if worker else None,
        preemptions=probe.metric_sum(PREEMPTIONS) - start_preemptions,
        health=probe.health(),
        seconds_to_idle=seconds_to_idle,
    )


def passed(counts, after: AfterTraffic, alive: bool) -> bool:
    return (
        counts.total("5xx") == 0 and counts.total("transport") == 0 and counts.unexpected_4xx == 0
        and after.leaked_blocks == 0 and after.usage == 0 and after.worker_requests == 0
        and after.health == 200 and alive
    )


def summary(args: argparse.Namespace, counts, after: AfterTraffic, wall_s: float, alive: bool) -> str:
    from vllm_kvevict.soak.traffic import OUTCOMES

    sent = sum(sum(kind.values()) for kind in counts.by_kind.values())
    worker = "not exposed" if after.worker_requests is None else f"{after.worker_requests:g} requests"
    server = (
        f"the server at {args.base_url} (its own settings)" if args.base_url is not None else
        f"{args.method} @ {args.budget}, {args.num_kv_blocks} blocks of {args.block_size} tokens, "
        f"max_model_len {args.max_model_len}"
    )
    lines = [
        f"soak: {wall_s / 60:.1f} min of traffic from {args.concurrency} clients; {server}",
        "",
        "| kind | " + " | ".join(OUTCOMES) + " |",
        "|---|" + "---:|" * len(OUTCOMES),
        *(f"| {kind} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |"
          for kind, c in counts.by_kind.items()),
        "",
        f"- requests sent: {sent}; served {counts.total('served')}, aborted by the client "
        f"{counts.total('aborted')}, 4xx {counts.total('4xx')} (to valid requests: {counts.unexpected_4xx}), "
        f"5xx {counts.total('5xx')}, transport errors {counts.total('transport')}",
        f"- generated tokens: {counts.generated_tokens}",
        f"- preemptions: {after.preemptions:g}",
        f"- leaked blocks: {after.leaked_blocks} ({USAGE} = {after.usage:g}, "
        f"{after.seconds_to_idle:.1f} s after the traffic stopped)",
        f"- worker eviction state left: {worker}",
        f"- /health: {after.health}; server process {'running' if alive else 'DEAD'}",
        f"- verdict: {'PASS' if passed(counts, after, alive) else 'FAIL'}",
    ]
    if counts.problems:
        lines += ["", "first problems:", *(f"  {problem}" for problem in counts.problems)]
    return "\n".join(lines)


def append_summary(args: argparse.Namespace, report: str) -> None:
    from vllm_kvevict.bench.report import machine_description

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    argv = sys.argv[sys.argv.index("soak") + 1:]
    if "--machine" in argv:  # shown on its own line
        del argv[argv.index("--machine"):argv.index("--machine") + 2]
    command = "vllm-kvevict soak " + shlex.join(argv)
    section = (
        f"\n### Soak of {now}\n\n- Machine: {args.machine or machine_description()}\n"
        f"- Command: `{command}`\n\n{report}\n"
    )
    text = args.append.read_text() if args.append.exists() else "# Reliability\n"
    args.append.write_text(text.rstrip("\n") + "\n" + section)
    print(f"[soak] appended to {args.append}", file=sys.stderr)
