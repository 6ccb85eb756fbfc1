"""KVzap's threshold mode through the server: answers and the blocks a request holds, beside a fixed budget
and vanilla vLLM, on the eval suite's prompts.

For vanilla and each ``--setting`` (a JSON object: ``label``, ``method``, ``budget`` and optional ``config``,
the ``--kv-eviction-config`` object) one server is started
(eager, block size 32, the same KV pool), ``vllm-kvevict eval --base-url`` answers the prompts, and the
server's counters give the blocks freed per compacted request. Printed per setting: mean score, its ratio to
vanilla's, and the share of a prompt's blocks a request holds after its prompt (1 - freed / prompt blocks).

    python -m benchmarks.threshold_served --tasks niah_single_essay,niah_single_noise --samples 2 \
        --setting '{"label": "tau0", "method": "kvzap", "budget": 0.5, "config": {"threshold": 0}}' \
        --out docs/results/2026-11-29-threshold-served

``--server-args '--max-num-batched-tokens 512'`` gives every server (vanilla's too) the same extra flags, e.g.
vLLM's chunk size for per-chunk eviction. Each eviction server also writes the debug dump of every compacted
prompt (``KVEVICT_DEBUG_DUMP_DIR``, a temporary folder): the share of its (layer, head, token) entries each
prompt kept, per task as min / mean / max (``kept_share``), shows how a threshold's count follows the prompt.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from vllm_kvevict.cli.model_catalog import DEFAULT_MODEL, MODELS
from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.server_process import VLLMServer

BLOCK_SIZE = 32
FREED = "vllm_kvevict_blocks_freed_total"
COMPACTED = "vllm_kvevict_requests_compacted_total"


def counter(server: VLLMServer, name: str) -> float:
    return sum(value for _, value in server.metric_samples(name))


def eviction_flags(setting: dict) -> list[str]:
    """``vllm serve`` flags of one ``--setting`` object."""
    flags = ["--kv-eviction", setting["method"], "--kv-budget", str(setting["budget"])]
    if setting.get("config"):
        flags += ["--kv-eviction-config", json.dumps(setting["config"])]
    return flags


def kept_share(dump_dir: Path, rows: list[dict]) -> dict[str, list[float]]:
    """Per task, [min, mean, max] over its prompts of the share of (layer, head, token) entries each kept,
    from the dumps of the compacted prompts (written in the order the prompts were sent, one at a time); {}
    when not every prompt was compacted."""
    dumps = sorted(dump_dir.glob("*.pt"), key=lambda path: path.stat().st_mtime_ns)
    if len(dumps) != len(rows):
        return {}
    by_task: dict[str, list[float]] = {}
    for row, path in zip(rows, dumps, strict=True):
        record = torch.load(path)
        assert record["prompt_len"] == row["served_prompt_tokens"], (path, row["sample_id"])
        counts = torch.stack(record["counts"])  # [L, H]
        share = float(counts.sum()) / (counts.numel() * record["prompt_len"])
        by_task.setdefault(row["task"], []).append(share)
    return {task: [min(v), sum(v) / len(v), max(v)] for task, v in by_task.items()}


def run_setting(model_dir: Path, label: str, flags: list[str], args: argparse.Namespace) -> dict:
    """One server: its eval results file, mean score, blocks freed per compacted request and the kept share
    per task."""
    output = args.out / f"{label}.jsonl"
    server_args = ("--block-size", str(BLOCK_SIZE), "--max-model-len", str(args.max_model_len),
                   *args.server_args, *flags)
    with tempfile.TemporaryDirectory() as dump_dir:
        env = {DEBUG_DUMP_ENV: dump_dir} if flags else {}
        log_path = args.out / f"{label}.log"
        with VLLMServer(model_dir, extra_args=server_args, log_path=log_path, env=env) as server:
            command = [sys.executable, "-m", "vllm_kvevict.cli.main", "eval", "--base-url", server.base_url,
                       "--tokenizer", str(model_dir),
                       "--tasks", args.tasks, "--lengths", args.lengths, "--samples", str(args.samples),
                       "--seed", str(args.seed),
                       "--concurrency", "1", "--output", str(output), "--no-progress"]  # fmt: skip
            subprocess.run(command, check=True)
            freed, compacted = counter(server, FREED), counter(server, COMPACTED)
        rows = [json.loads(line) for line in output.read_text().splitlines() if line.strip()]
        shares = kept_share(Path(dump_dir), rows) if flags else {}
    prompt_blocks = sum(cdiv(row["served_prompt_tokens"], BLOCK_SIZE) for row in rows) / len(rows)
    return {
        "kept_share": shares,
        "label": label,
        "flags": flags,
        "score": sum(row["score"] for row in rows) / len(rows),
        "prompts": len(rows),
        "compacted": compacted,
        "freed_per_request": freed / compacted if compacted else 0.0,
        "held_share": 1.0 - (freed / compacted / prompt_blocks if compacted else 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the eval prompts' seed (another: other prompts)")
    parser.add_argument("--setting", action="append", default=[], type=json.loads, help="JSON object")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS), help="catalogued model")
    parser.add_argument("--max-model-len", type=int, default=8192, help="of every server")
    parser.add_argument("--vanilla", type=Path, help="a summary.json whose vanilla row to reuse (no server)")
    parser.add_argument(
        "--server-args", type=shlex.split, default=[], help="more `vllm serve` flags for every server"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = prepared_model_dir(model=args.model)
    settings = [(setting["label"], eviction_flags(setting)) for setting in args.setting]
    if args.vanilla is None:
        results = [run_setting(model_dir, "vanilla", [], args)]
    else:
        results = [row for row in json.loads(args.vanilla.read_text()) if row["label"] == "vanilla"]
    results += [run_setting(model_dir, label, flags, args) for label, flags in settings]
    base = results[0]["score"]
    print("| setting | score | x vanilla | blocks held after the prompt (share) | compacted |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        ratio = r["score"] / base if base else float("nan")
        held, compacted = r["held_share"], r["compacted"]
        print(f"| {r['label']} | {r['score']:.3f} | {ratio:.2f} | {held:.3f} | {compacted:g} |")
    for r in results:
        if r.get("kept_share"):
            spread = ", ".join(
                f"{task} {lo:.3f}/{mean:.3f}/{hi:.3f}" for task, (lo, mean, hi) in r["kept_share"].items()
            )
            print(f"{r['label']}: kept share per task (min/mean/max): {spread}")
    (args.out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
