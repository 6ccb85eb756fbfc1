"""Host time of the eviction bookkeeping per decode step, without a server or attention kernels.

Drives the worker-side classes (``EvictionWorker`` → ``EvictionStep``) with fake inputs shaped like vLLM's:
R requests with P-token prompts are compacted (a fake policy returns fixed kept tokens at once, SnapKV-like
uniform counts or Ada-KV-like ragged ones, so scoring is not timed), then decode steps are timed: the runner
hook's ``begin_step``, the builder's ``make_step``, the head-as-sequence metadata of every layer
(``head_batch``) and ``end_step``. That is everything the eviction datapath adds on the host to a decode step
besides the attention call itself.

Time is the calling thread's CPU time (``time.thread_time``) with torch on one thread, median (min) over the
timed steps: on a shared machine wall time mostly measures the other processes (the JSON keeps the wall
median too).

With ``--device cuda`` the sub-block tables, vLLM's block table and slot mapping live on the GPU (as in a
server) and each decode step runs under ``torch.cuda.set_sync_debug_mode(--sync-debug)``: "error" fails the
run at the first host-device synchronisation, "warn" lists every one with its stack and goes on. The JSON
then also holds the GPU time of the step's bookkeeping kernels (CUDA events, synchronised after the step).

    python benchmarks/host_overhead.py --label after --json /tmp/after.json
    python benchmarks/host_overhead.py --compare /tmp/before.json /tmp/after.json   # markdown table

The same script measures an older tree: put that tree first on ``PYTHONPATH`` (e.g. ``git archive HEAD
vllm_kvevict | tar -x -C /tmp/old``; the script prints the path it imported the worker from).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

from vllm_kvevict.datapath import worker as eviction_step_module
from vllm_kvevict.datapath.worker import EvictionWorker, StepInputs
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.policies.base import KeptTokens
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.settings.config import EvictionConfig

PREFILL_CHUNK = 8  # requests compacted per prefill step while setting up


def fake_select(ragged: bool, num_heads: int, prompt_len: int, seed: int):
    """A policy ``select`` returning fixed kept tokens: ``budget`` per head, or a ragged split summing to
    ``H * budget`` (each head in [0, P]) like Ada-KV's; the first B_h prompt tokens of each head."""
    generator = torch.Generator().manual_seed(seed)

    def select(layer, budget: int) -> KeptTokens:
        total = num_heads * budget
        if ragged:
            weights = 0.25 + 1.5 * torch.rand(num_heads, generator=generator)
            counts = (total * weights / weights.sum()).floor().clamp(max=prompt_len).to(torch.int64)
            for head in itertools.cycle(range(num_heads)):
                if int(counts.sum()) == total:
                    break
                if counts[head] < prompt_len:
                    counts[head] += 1
        else:
            counts = torch.full((num_heads,), budget, dtype=torch.int64)
        width = int(counts.max())
        positions = torch.arange(width).expand(num_heads, width)
        indices = torch.where(positions < counts[:, None], positions, -1)
        device = layer.keys.device  # a real policy scores on the cache's device and returns its result there
        return KeptTokens(indices=indices.to(device), counts=counts.to(device))

    return select


class FakeBatch:
    """Block rows of R requests as vLLM's worker sees them (freed leading blocks become the null block 0)."""

    def __init__(self, num_reqs: int, prompt_len: int, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.width = cdiv(max_model_len, block_size)
        self.next_block = itertools.count(1)
        self.rows = [
            [next(self.next_block) for _ in range(cdiv(prompt_len, block_size))] for _ in range(num_reqs)
        ]

    def free_leading(self, index: int, blocks: int) -> None:
        self.rows[index][:blocks] = [0] * blocks

    def tensors(self, indices: list[int], seq_lens: list[int], q_lens: list[int]):
        """(block_table [R, W] int32, slot mapping [T] int64) for the requests ``indices``."""
        table = torch.zeros(len(indices), self.width, dtype=torch.int32)
        slots = []
        for i, (index, seq_len, q_len) in enumerate(zip(indices, seq_lens, q_lens, strict=True)):
            row = self.rows[index]
            while len(row) < cdiv(seq_len, self.block_size):
                row.append(next(self.next_block))
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
            positions = torch.arange(seq_len - q_len, seq_len)
            slots.append(
                table[i, positions // self.block_size].to(torch.int64) * self.block_size
                + positions % self.block_size
            )
        return table, torch.cat(slots)


class SyncLog:
    """Host-device synchronisations seen while ``torch.cuda.set_sync_debug_mode("warn")`` is on."""

    def __init__(self) -> None:
        self.stacks: dict[str, int] = {}

    def record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing cuda operation" not in str(message).lower():
            return  # e.g. the notice that sync debug mode is a prototype
        stack = "".join(traceback.format_stack(limit=12)[:-2])
        key = f"{message}\n{stack}"
        self.stacks[key] = self.stacks.get(key, 0) + 1


class SyncDebug:
    """``with SyncDebug(device, mode)``: the block runs under CUDA's sync debug mode (nothing on CPU)."""

    def __init__(self, device: torch.device, mode: str, log: SyncLog) -> None:
        self.active = device.type == "cuda" and mode != "off"
        self.mode, self.log = mode, log

    def __enter__(self) -> None:
        if self.active:
            self._saved = warnings.catch_warnings()  # restores the filters and showwarning on exit
            self._saved.__enter__()
            warnings.showwarning = self.log.record
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(self.mode)

    def __exit__(self, *exc) -> None:
        if self.active:
            torch.cuda.set_sync_debug_mode("default")
            self._saved.__exit__(*exc)


def run_case(method: str, num_reqs: int, block_size: int, args: argparse.Namespace) -> dict:
    heads, layers, prompt = args.heads, args.layers, args.prompt
    device = torch.device(args.device)
    policy = build_policy(method)
    policy.select = fake_select(method.startswith("ada"), heads, prompt, seed=num_reqs * 131 + block_size)
    worker = EvictionWorker(policy, EvictionConfig(method, args.budget), layers, heads, block_size)
    plan = worker.plan_for(prompt)
    assert plan.compacts, "the budget must be below the prompt"
    batch = FakeBatch(num_reqs, prompt, block_size, prompt + args.max_new + block_size)
    req_ids = [f"req-{i}" for i in range(num_reqs)]
    num_q_heads = heads * args.heads_per_group

    # Prefill + compaction, PREFILL_CHUNK requests per step (the keys/values are never read: zero strides).
    for start in range(0, num_reqs, PREFILL_CHUNK):
        chunk = list(range(start, min(num_reqs, start + PREFILL_CHUNK)))
        tokens = prompt * len(chunk)
        worker.begin_step(
            StepInputs(
                [req_ids[i] for i in chunk],
                np.full(len(chunk), prompt),
                np.zeros(len(chunk), dtype=np.int64),
                np.full(len(chunk), prompt),
            )
        )
        table, slots = batch.tensors(chunk, [prompt] * len(chunk), [prompt] * len(chunk))
        seq_lens = torch.full((len(chunk),), prompt, device=device)
        step = worker.make_step(len(chunk), tokens, seq_lens, table.to(device), slots.to(device))
        query = torch.zeros(1, num_q_heads, args.head_dim, device=device).expand(tokens, num_q_heads, -1)
        kv = torch.zeros(1, heads, args.head_dim, device=device).expand(tokens, heads, -1)
        for layer in range(layers):
            step.compact_layer(layer, query, kv, kv)
        worker.end_step()
        for i in chunk:
            batch.free_leading(i, plan.blocks_to_free)

    # Decode steps: every request computes one token; only the host work is timed.
    all_reqs = list(range(num_reqs))
    samples, cpu_samples, gpu_samples = [], [], []
    sync_log = SyncLog()
    for t in range(args.max_new):
        computed = prompt + t
        inputs = StepInputs(
            list(req_ids),
            np.full(num_reqs, prompt),
            np.full(num_reqs, computed),
            np.ones(num_reqs, dtype=np.int64),
        )
        # vLLM's inputs are on the device before the step's hooks run: copy them outside the timed part
        host_inputs = batch.tensors(all_reqs, [computed + 1] * num_reqs, [1] * num_reqs)
        table, slots = (x.to(device) for x in host_inputs)
        seq_lens = torch.full((num_reqs,), computed + 1, dtype=torch.int32, device=device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else []
        if events:
            torch.cuda.synchronize(device)
            events[0].record()
        started, started_cpu = time.perf_counter(), time.thread_time()
        with SyncDebug(device, args.sync_debug, sync_log):
            worker.begin_step(inputs)
            step = worker.make_step(num_reqs, num_reqs, seq_lens, table, slots)
            assert step is not None and step.has_compacted
            for layer in range(layers):
                step.head_batch(layer)
            worker.end_step()
        samples.append(time.perf_counter() - started)
        cpu_samples.append(time.thread_time() - started_cpu)
        if events:
            events[1].record()
            torch.cuda.synchronize(device)
            gpu_samples.append(events[0].elapsed_time(events[1]) / 1000)
        if len(samples) >= args.min_steps and sum(samples) > args.seconds:
            break
    first = 1 if len(samples) > 2 else 0  # the first step after the prefills moves every request's rows
    warm, warm_cpu = samples[first:], cpu_samples[first:]
    row = {
        "method": method,
        "batch": num_reqs,
        "block_size": block_size,
        "ms_per_step": 1000 * statistics.median(warm_cpu),
        "ms_min": 1000 * min(warm_cpu),
        "wall_ms_per_step": 1000 * statistics.median(warm),
        "steps": len(samples),
    }
    if gpu_samples:
        row["gpu_ms_per_step"] = 1000 * statistics.median(gpu_samples[first:])
        row["sync_debug"] = args.sync_debug
        row["syncs"] = sum(sync_log.stacks.values())
        for stack, count in sync_log.stacks.items():
            print(f"--- {count} synchronisation(s) in decode steps ({method}, batch {num_reqs}):\n{stack}")
    return row


def markdown(results: list[dict], columns: dict[str, list[dict]]) -> str:
    header = (
        "| method | block size | batch | "
        + " | ".join(f"{name}: CPU ms/step (min)" for name in columns)
        + " |"
    )
    lines = [header, "|" + " --- |" * (3 + len(columns))]
    for row in results:
        key = (row["method"], row["block_size"], row["batch"])
        cells = []
        for rows in columns.values():
            match = [r for r in rows if (r["method"], r["block_size"], r["batch"]) == key]
            if match:
                row_min = match[0].get("ms_min")
                extra = f" ({row_min:.3g})" if row_min is not None else ""
                cells.append(f"{match[0]['ms_per_step']:.3g}{extra}")
            else:
                cells.append("—")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", default="snapkv,ada-snapkv")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--block-sizes", default="16,32")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--heads-per-group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=1024, help="kept tokens per KV head")
    parser.add_argument("--max-new", type=int, default=64, help="most decode steps timed per case")
    parser.add_argument("--min-steps", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0, help="stop timing a case after this long")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="where the tables live: cpu or cuda")
    parser.add_argument(
        "--sync-debug",
        default="error",
        choices=["error", "warn", "off"],
        help="CUDA sync debug mode during decode steps (--device cuda only)",
    )
    parser.add_argument("--label", default="run")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--compare", type=Path, nargs="+", help="print one table from earlier --json files")
    args = parser.parse_args()

    if args.compare:
        runs = [json.loads(path.read_text()) for path in args.compare]
        print(markdown(runs[0]["results"], {run["label"]: run["results"] for run in runs}))
        return
    # One thread by default: on a shared machine OpenMP's waits for a second busy core dominate small ops.
    torch.set_num_threads(args.threads)
    print(
        f"worker from {eviction_step_module.__file__}; {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads"
    )
    results = []
    for method in args.methods.split(","):
        for block_size in (int(b) for b in args.block_sizes.split(",")):
            for num_reqs in (int(b) for b in args.batches.split(",")):
                row = run_case(method, num_reqs, block_size, args)
                gpu = f", GPU {row['gpu_ms_per_step']:.3f} ms, {row['syncs']} syncs" if "syncs" in row else ""
                print(
                    f"{method:12s} bs={block_size:3d} batch={num_reqs:4d}: {row['ms_per_step']:9.3f} ms/step "
                    f"({row['steps']} steps{gpu})",
                    flush=True,
                )
                results.append(row)
    print(markdown(results, {args.label: results}))
    if args.device.startswith("cuda"):
        print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, sync debug {args.sync_debug}")
        print("| method | block size | batch | host CPU ms/step | host wall ms/step | GPU ms/step | syncs |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in results:
            print(
                f"| {row['method']} | {row['block_size']} | {row['batch']} | {row['ms_per_step']:.3g} | "
                f"{row['wall_ms_per_step']:.3g} | {row['gpu_ms_per_step']:.3g} | {row['syncs']} |"
            )
    if args.json:
        record = {"label": args.label, "args": vars(args), "results": results}
        args.json.write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
