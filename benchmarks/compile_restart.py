"""Start-up of a compiled server, twice from empty caches, with vLLM's AOT compile on and off (issue 11).

For each ``VLLM_USE_AOT_COMPILE`` value: fresh ``VLLM_CACHE_ROOT`` and ``TORCHINDUCTOR_CACHE_DIR``, a vanilla
compiled server started twice, then (AOT off only) once more with eviction. One JSON line per start: seconds
until ``/health`` answers, vLLM's own "init engine ... took" seconds, whether the log shows the AOT artifact
failing to load, and the greedy answer to one prompt.

    .venv/bin/python benchmarks/compile_restart.py OUT.jsonl
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path

from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.cpu_setup import AOT_COMPILE_ENV
from vllm_kvevict.server_process import VLLMServer

INIT_ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
AOT_LOAD_ERROR = "finalize_loading"
EVICTION_ARGS = ("--kv-eviction", "ada-snapkv", "--kv-budget", "512")
STARTS = {"1": [()] * 2, "0": [(), (), EVICTION_ARGS]}  # AOT_COMPILE_ENV value -> extra args per start


def start_once(model: Path, env: dict[str, str], extra: tuple[str, ...], log: Path) -> dict:
    """One compiled start: ready seconds, vLLM's init seconds, the AOT load error, one greedy answer."""
    from openai import OpenAI

    began = time.monotonic()
    server = VLLMServer(model, extra_args=("--block-size", "32", *extra), env=env, enforce_eager=False,
                        startup_timeout_s=1800, log_path=log)  # fmt: skip
    with server:
        ready = time.monotonic() - began
        text = (
            OpenAI(base_url=server.base_url, api_key="unused")
            .completions.create(
                model=server.served_model_name, prompt="The capital of France is", max_tokens=8, temperature=0
            )
            .choices[0]
            .text
        )
    body = log.read_text(errors="replace")
    init = INIT_ENGINE.findall(body)
    return {
        "ready_s": round(ready, 1),
        "init_engine_s": float(init[-1]) if init else None,
        "aot_load_error": AOT_LOAD_ERROR in body,
        "text": text,
    }


def main(out: Path) -> None:
    model = prepared_model_dir()
    for aot, starts in STARTS.items():
        root = Path(tempfile.mkdtemp(prefix=f"aot{aot}-"))
        env = {
            AOT_COMPILE_ENV: aot,
            "VLLM_CACHE_ROOT": str(root / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        }
        for index, extra in enumerate(starts):
            row = {"aot": aot, "start": index, "eviction": bool(extra)}
            row |= start_once(model, env, extra, root / f"start{index}.log")
            print(json.dumps(row), flush=True)
            with out.open("a") as results:
                results.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: compile_restart.py OUT.jsonl")
    main(Path(sys.argv[1]))
