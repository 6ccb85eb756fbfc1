"""``vllm-kvevict bench``: capacity and throughput of vanilla vLLM vs vLLM with KV eviction.

Both servers run in the same invocation, one after the other, with the same KV pool
(``VLLM_CPU_KVCACHE_SPACE`` and optionally ``--num-kv-blocks``), the same model and the same prompts. The
whole workload is sent at once so that the KV pool, not the client, limits how many requests run together.
Both run at vLLM's defaults (compiled model, chunked prefill, prefix caching on), the baseline users compare
against, unless ``--eager`` puts ``--enforce-eager`` on both.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from vllm_kvevict.server_process import add_eager_flag, server_mode_text, startup_timeout_for


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="Capacity/throughput benchmark: vanilla vs eviction servers, same KV pool.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model-dir", type=Path, default=None, help="HF model directory (default: the bundled model)")
    add("--method", default="ada-snapkv", help="eviction method (default: ada-snapkv)")
    add("--budget", default="0.25", help="--kv-budget of the eviction server (default: 0.25)")
    add("--num-prompts", type=int, default=32, help="prompts in the workload (default: 32)")
    add("--prompt-tokens", type=int, default=4000, help="tokens per prompt (default: 4000)")
    add("--output-tokens", type=int, default=128, help="generated tokens per request (default: 128)")
    add("--concurrency", type=int, default=None, help="client-side cap (default: all requests at once)")
    add("--kv-cache-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of both (default: 1)")
    add(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="--num-gpu-blocks-override of both: a pool small enough to be the bottleneck on a small CPU",
    )
    add(
        "--kv-cache-dtype",
        default="auto",
        help="--kv-cache-dtype of both servers, vanilla too (e.g. fp8; default: auto, the model's dtype)",
    )
    add("--server-arg", action="append", default=[], help="extra `vllm serve` argument for both (repeatable)")
    add(
        "--kv-eviction-config",
        default=None,
        help="--kv-eviction-config of the eviction server only, e.g. '{\"prefill\": \"chunked\"}'",
    )
    add(
        "--eviction-arg",
        action="append",
        default=[],
        help="extra `vllm serve` argument of the eviction server only (repeatable), e.g. "
        "--eviction-arg=--kv-decode-eviction --eviction-arg=kvzap",
    )
    add(
        "--client",
        choices=("openai", "vllm"),
        default="openai",
        help="openai: the bench's own streaming client over prose-like prompts (default; the runs before "
        "2026-11-29); vllm: vLLM's own `vllm bench serve` with random prompts of the same lengths",
    )
    add("--seed", type=int, default=0, help="workload seed (default: 0)")
    add_eager_flag(add)
    add("--append", type=Path, default=None, help="append the table to this markdown file")
    add("--machine", default=None, help="machine description for the markdown (default: probed)")
    parser.set_defaults(handler=run)


def common_server_args(args: argparse.Namespace) -> list[str]:
    common = ["--max-model-len", str(args.prompt_tokens + args.output_tokens + 64), *args.server_arg]
    if args.kv_cache_dtype != "auto":
        common += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.num_kv_blocks is not None:
        common += ["--num-gpu-blocks-override", str(args.num_kv_blocks)]
    return common


def server_runs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, extra `vllm serve` args): vanilla first, it is the baseline of every ratio."""
    eviction = ["--kv-eviction", args.method, "--kv-budget", str(args.budget)]
    if args.kv_eviction_config is not None:
        eviction += ["--kv-eviction-config", args.kv_eviction_config]
    eviction += args.eviction_arg
    return [
        ("vanilla", common_server_args(args)),
        (f"{args.method} @ {args.budget}", common_server_args(args) + eviction),
    ]


def settings_text(args: argparse.Namespace) -> str:
    client = "the bench's client" if args.client == "openai" else "`vllm bench serve`, random prompts"
    text = (
        f"{args.num_prompts} prompts × {args.prompt_tokens} tokens, {args.output_tokens} output tokens "
        f"(ignore_eos), all sent at once ({client}); VLLM_CPU_KVCACHE_SPACE={args.kv_cache_space_gib} GiB; "
        f"both servers: {server_mode_text(args.eager)}"
    )
    if args.kv_cache_dtype != "auto":
        text += f", --kv-cache-dtype {args.kv_cache_dtype}"
    if args.num_kv_blocks is not None:
        text += f", --num-gpu-blocks-override {args.num_kv_blocks}"
    return text


def run(args: argparse.Namespace) -> int:
    from vllm_kvevict.bench.report import (
        append_to_benchmarks,
        machine_description,
        markdown_section,
        ratio_table,
    )
    from vllm_kvevict.bench.workload import build_workload
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    model_dir = args.model_dir or prepared_model_dir()
    print(f"[bench] both servers: {server_mode_text(args.eager)}", file=sys.stderr, flush=True)
    workload = build_workload(model_dir, args.num_prompts, args.prompt_tokens, args.output_tokens, args.seed)
    results = [bench_server(model_dir, label, extra, workload, args) for label, extra in server_runs(args)]
    print(ratio_table(results))
    if args.append is not None:
        command = "vllm-kvevict bench " + shlex.join(sys.argv[sys.argv.index("bench") + 1 :])
        machine = args.machine or machine_description()
        append_to_benchmarks(args.append, markdown_section(results, settings_text(args), command, machine))
        print(f"[bench] appended to {args.append}", file=sys.stderr)
    return 0


def bench_server(model_dir: Path, label: str, extra: list[str], workload, args: argparse.Namespace):
    """Start one server, warm it up, run the workload while polling /metrics, stop it."""
    from vllm_kvevict.bench.client import run_workload
    from vllm_kvevict.bench.metrics_poller import MetricsPoller
    from vllm_kvevict.bench.report import summarise
    from vllm_kvevict.bench.workload import Workload
    from vllm_kvevict.server_process import VLLMServer

    print(f"[bench] {label}: vllm serve {model_dir} {shlex.join(extra)}", file=sys.stderr, flush=True)
    with VLLMServer(
        model_dir,
        extra_args=tuple(extra),
        kv_cache_space_gib=args.kv_cache_space_gib,
        enforce_eager=args.eager,
        startup_timeout_s=startup_timeout_for(args.eager),
    ) as server:
        model = server.served_model_name
        run_workload(server.base_url, model, Workload(prompts=[workload.prompts[0][:32]], output_tokens=4), 1)
        with MetricsPoller(server.root_url + "/metrics") as poller:
            if args.client == "vllm":
                timing = vllm_bench_serve(server, model_dir, args)
            else:
                concurrency = args.concurrency or len(workload.prompts)
                timing = run_workload(server.base_url, model, workload, concurrency)
    result = summarise(label, timing, poller.peaks)
    print(f"[bench] {label}: {result}", file=sys.stderr, flush=True)
    return result


def vllm_bench_serve(server, model_dir: Path, args: argparse.Namespace):
    """The workload's shape through ``vllm bench serve`` (``--client vllm``) on a started server."""
    import tempfile

    from vllm_kvevict.bench.vllm_client import bench_serve_command, run_bench_serve

    with tempfile.TemporaryDirectory() as results_dir:
        result = Path(results_dir) / "result.json"
        command = bench_serve_command(
            server.root_url,
            server.served_model_name,
            model_dir,
            args.num_prompts,
            args.prompt_tokens,
            args.output_tokens,
            args.seed,
            result,
            args.concurrency,
        )
        return run_bench_serve(command, result)
