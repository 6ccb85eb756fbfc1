"""Stages ``bench <shape>``: ``vllm bench serve`` on model shapes (``shapes.py``), vanilla against eviction.

    python3 -m benchmarks.gpu.bench_shapes SHAPE_DIR [SHAPE_DIR ...] OUT_DIR [--prompt-lens 8192,16384]
        [--output-len 256] [--dry-run]

``SHAPE_DIR`` is a folder ``shapes.write_model_dir`` made (config and stand-in tokenizer; dummy weights);
the servers of several start together (one start for shapes whose servers fit the GPU side by side), then
each shape's runs go in turn.
One vanilla (``TRITON_ATTN``) and one eviction server (``CUSTOM``, ada-snapkv at 25 %) start together on the
same KV pool, sized from the shape so that vanilla holds ``POOL_REQUESTS`` requests of the shortest workload
(half as many of one twice as long), each with the GPU memory share its weights, pool and activations need.
Prefix caching is off on both (each run draws the same seeded prompts). For each prompt length: random
prompts of exactly that length, ``OUTPUT_LEN`` output tokens, rate inf,
``PROMPT_WAVES`` times the requests vanilla holds (enough to fill 25 %'s capacity; the 10 % row is capped by
the prompt count where its limit is higher, and its running requests show it); rows: vanilla, ada-snapkv at
25 % (the server's) and 10 % (per request), and the method the project keeps contexts with by default
(``learned_methods.KEPT_CONTEXT_AS``: ada-kvzap, a learned scorer) at 25 % per request where a scorer ships
for the shape. Where none does (only SmolLM2's is packaged; a scorer is calibrated on a model's real
activations, which dummy weights do not have) the row is not run: one request asks for it and the server's
HTTP 400 is recorded as the row. Each row reports output tok/s, TTFT, TPOT, the most and mean running
requests, peak KV (share of the pool and GiB), and against vanilla of its length the ratios and the limits
(capacity (P+out)/(B+out); decode (weights + kept KV reads)/(weights + all KV reads) at vanilla's batch).
Results: ``OUT_DIR/bench-<shape>.{json,md}``, each run's JSON and log beside them.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from benchmarks.gpu import serve_flags, shapes
from benchmarks.gpu.bench_serve import client_command, measure, ratios_against
from benchmarks.gpu.servers import BundleServer, start_all

PROMPT_LENS = (8192, 16384)
OUTPUT_LEN = 256
METHOD = "ada-snapkv"
BUDGETS = (0.25, 0.1)
#: Prompts per length: this many times what vanilla holds at once.
PROMPT_WAVES = 4
RUN_TIMEOUT_S = 240.0
NO_PREFIX_CACHING = "--no-enable-prefix-caching"


def kept_context(model_dir: Path) -> dict:
    """The method the project keeps a context with by default, and the packaged scorer of this shape (None
    where none ships: a learned method is then refused at the server, per request)."""
    from vllm_kvevict.policies.surrogate_scorer import find_packaged_scorer, model_fingerprint
    from vllm_kvevict.settings.learned_methods import KEPT_CONTEXT_AS

    config = json.loads((model_dir / "config.json").read_text())
    scorer = find_packaged_scorer(model_fingerprint(SimpleNamespace(**config)))
    return {"method": KEPT_CONTEXT_AS[METHOD], "budget": BUDGETS[0],
            "scorer": scorer.name if scorer is not None else None}


def gpu_bytes() -> tuple[int, str]:
    """This machine's GPU memory and name; without a GPU (the dry run) the nominal H100's."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.mem_get_info()[1], torch.cuda.get_device_name()
    except ImportError:
        pass
    return shapes.NOMINAL_GPU_BYTES, "none (sized for a nominal 79.1 GiB H100)"


def plan(shape: shapes.Shape, model_dir: Path, prompt_lens: tuple[int, ...], output_len: int,
         memory: int) -> dict:
    """The pool, each server's memory share, the kept-context decision and every run: label, prompt
    length, prompts, the request's ``vllm_xargs`` and which server serves it."""
    pool = shapes.pool_blocks(min(prompt_lens), output_len)
    max_len = max(prompt_lens) + output_len + serve_flags.BLOCK_SIZE
    context = kept_context(model_dir)
    runs = []
    for prompt_len in prompt_lens:
        held = shapes.vanilla_requests(pool, prompt_len, output_len)
        length = f"{prompt_len // 1024}k" if prompt_len % 1024 == 0 else str(prompt_len)
        common = {"prompt_len": prompt_len, "num_prompts": PROMPT_WAVES * held, "vanilla_requests": held}
        runs.append({"label": f"{length}-vanilla", "server": "vanilla", "budget": None, "xargs": None,
                     **common})
        for i, budget in enumerate(BUDGETS):
            runs.append({"label": f"{length}-{METHOD}-{budget}", "server": "eviction", "budget": budget,
                         "xargs": None if i == 0 else {"kv_budget": budget}, **common})
        if context["scorer"] is not None:
            runs.append({"label": f"{length}-{context['method']}-{context['budget']}", "server": "eviction",
                         "budget": context["budget"], **common,
                         "xargs": {"kv_eviction": context["method"], "kv_budget": context["budget"]}})
    return {"shape": shape.name, "pool_blocks": pool, "block_size": serve_flags.BLOCK_SIZE,
            "pool_bytes": shapes.pool_bytes(shape, pool),
            "max_model_len": max_len, "memory_share": shapes.memory_share(shape, pool, max_len, memory),
            "gpu_bytes": memory, "kept_context": context, "runs": runs}


def dataset(prompt_len: int, output_len: int) -> list[str]:
    return ["--dataset-name", "random", "--random-input-len", str(prompt_len), "--random-output-len",
            str(output_len), "--random-range-ratio", "0"]


def servers(shape: shapes.Shape, model_dir: Path, planned: dict, logs: Path) -> dict[str, BundleServer]:
    # No prefix caching: every run of a server draws the same seeded prompts, and its warm-up requests are the
    # run's first; a cache would serve later runs' prompts from earlier ones'.
    pool = [*serve_flags.pool_args(planned["pool_blocks"]), NO_PREFIX_CACHING]
    max_len, share = planned["max_model_len"], f"{planned['memory_share']:.2f}"
    flags = {"vanilla": serve_flags.vanilla_args(max_len),
             "eviction": serve_flags.eviction_args(max_len, method=METHOD, budget=str(BUDGETS[0]))}
    return {role: BundleServer(model_dir, [*flags[role], *pool], logs / f"bench-{shape.name}-{role}.log",
                               memory_share=share, served_model_name=shape.served_model_name)
            for role in flags}


def refusal(server: BundleServer, xargs: dict) -> str | None:
    """The server's answer to one short request with ``xargs``: an HTTP error's text; None: it served it."""
    body = {"model": server.served_model_name, "prompt": list(range(100, 164)), "max_tokens": 1,
            "vllm_xargs": xargs}
    request = urllib.request.Request(f"{server.base_url}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60):
            return None
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}: {error.read().decode(errors='replace')[:600]}"


def with_limits(row: dict, run: dict, shape: shapes.Shape, output_len: int, pool_bytes: int) -> dict:
    """``row`` with its run's facts, the peak KV in GiB and, for an eviction row, its limits."""
    row = {**row, "prompt_len": run["prompt_len"], "num_prompts": run["num_prompts"]}
    if "max_kv_usage" in row:
        row["peak_kv_gib"] = round(row["max_kv_usage"] * pool_bytes / shapes.GIB, 2)
    if run["budget"] is not None:
        row["capacity_limit"] = round(shapes.capacity_limit(run["prompt_len"], output_len, run["budget"]), 2)
        row["decode_limit"] = round(shapes.decode_limit(shape, run["prompt_len"], output_len, run["budget"],
                                                        run["vanilla_requests"]), 3)
    return row


def ratios(rows: list[dict]) -> list[dict]:
    """Each eviction row against the vanilla row of its prompt length."""
    vanilla = {r["prompt_len"]: r for r in rows if r["label"].endswith("-vanilla") and "error" not in r}
    out = []
    for row in rows:
        base = vanilla.get(row["prompt_len"])
        if row["label"].endswith("-vanilla") or base is None or "error" in row:
            continue
        out.append({**ratios_against(row, base),
                    "capacity_limit": row["capacity_limit"], "decode_limit": row["decode_limit"]})
    return out


COLUMNS = ("label", "output_throughput", "median_ttft_ms", "median_tpot_ms", "max_running", "mean_running",
           "max_kv_usage", "peak_kv_gib", "preemptions", "completed", "duration")


def markdown(result: dict) -> str:
    planned, shape = result["plan"], result["shape"]
    lines = [
        f"`{shape['name']}` ({shape['parameters'] / 1e9:.2f} B parameters, {shape['num_layers']} layers, "
        f"{shape['num_heads']} query / {shape['num_kv_heads']} KV heads, head dim {shape['head_dim']}; dummy "
        f"weights, stand-in tokenizer); GPU: {result['gpu']}; pool {planned['pool_blocks']} blocks x "
        f"{planned['block_size']} = {planned['pool_bytes'] / shapes.GIB:.2f} GiB "
        f"({shapes.SHAPES[shape['name']].kv_bytes_per_token()} B per token), memory share "
        f"{planned['memory_share']:.2f} per server; random prompts, {result['output_len']} output tokens, "
        "rate inf, eager", "",
        "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in result["rows"]:
        lines.append("| " + " | ".join(str(row.get(c, row.get("error", ""))) for c in COLUMNS) + " |")
    lines += ["", "| vs vanilla | output tok/s | max running (capacity limit) | TTFT p50 | TPOT p50 "
              "(decode limit at vanilla's batch) |", "|---|---|---|---|---|"]
    for r in result["ratios"]:
        lines.append(f"| {r['label']} | {r['output_tok_s']:.2f}x | {r['max_running']:.2f}x "
                     f"({r['capacity_limit']:.2f}x) | {r['ttft_p50']:.2f}x | {r['tpot_p50']:.2f}x "
                     f"({r['decode_limit']:.3f}x) |")
    context = planned["kept_context"]
    if context["scorer"] is None:
        lines.append(f"\n{context['method']} (the kept-context default) not run: no learned scorer ships for "
                     f"this shape; the server answered {result.get('kept_context_refusal')}")
    return "\n".join(lines) + "\n"


def write_result(result: dict, roles: dict[str, BundleServer], out: Path, name: str) -> None:
    result["ratios"] = ratios(result["rows"])
    result["missing_c_ops"] = sorted({op for server in roles.values() for op in server.missing_c_ops()})
    (out / f"bench-{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / f"bench-{name}.md").write_text(markdown(result))


class Bench:
    """One shape's servers, runs and result in a ``bench_shapes`` process."""

    def __init__(self, model_dir: Path, args: argparse.Namespace, memory: int, gpu: str) -> None:
        shape = shapes.shape_of(model_dir)
        if shape is None:
            raise SystemExit(f"{model_dir} has no {shapes.SHAPE_FILE}: write it with benchmarks.gpu.shapes")
        self.shape, self.model_dir, self.args = shape, model_dir, args
        lens = tuple(int(n) for n in args.prompt_lens.split(","))
        self.plan = plan(shape, model_dir, lens, args.output_len, memory)
        self.roles = servers(shape, model_dir, self.plan, args.out / "logs")
        self.result: dict = {"shape": {**asdict(shape), "parameters": shape.parameters()}, "gpu": gpu,
                             "output_len": args.output_len, "plan": self.plan, "rows": [], "ratios": []}

    def command(self, run: dict) -> list[str]:
        result_path = self.args.out / f"bench-{self.shape.name}-{run['label']}.json"
        flags = dataset(run["prompt_len"], self.args.output_len)
        server = self.roles[run["server"]]
        return client_command(server, self.model_dir, flags, run["num_prompts"], result_path, run["xargs"])

    def write_commands(self) -> None:
        name, out = self.shape.name, self.args.out
        commands = {"servers": {role: server.command for role, server in self.roles.items()},
                    "clients": {run["label"]: self.command(run) for run in self.plan["runs"]}}
        (out / f"commands-bench-{name}.json").write_text(json.dumps(commands, indent=1) + "\n")
        (out / f"plan-bench-{name}.json").write_text(json.dumps(self.plan, indent=1) + "\n")

    def run(self) -> None:
        """Every run on the started servers, the result written after each (a stage cut short keeps them)."""
        context, name = self.plan["kept_context"], self.shape.name
        if context["scorer"] is None:
            answer = refusal(self.roles["eviction"], {"kv_eviction": context["method"],
                                                      "kv_budget": context["budget"]})
            self.result["kept_context_refusal"] = answer
            if answer is None:
                self.result["error"] = f"{context['method']} was served on {name}, for which no scorer ships"
        for run in self.plan["runs"]:
            row = measure(self.roles[run["server"]], self.command(run),
                          self.args.out / f"bench-{name}-{run['label']}.json", self.args.run_timeout_s)
            self.result["rows"].append(with_limits({"label": run["label"], **row}, run, self.shape,
                                                   self.args.output_len, self.plan["pool_bytes"]))
            self.write()

    def write(self) -> None:
        write_result(self.result, self.roles, self.args.out, self.shape.name)

    @property
    def ok(self) -> bool:
        return "error" not in self.result and all("error" not in row for row in self.result["rows"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dirs", type=Path, nargs="+",
                        help="shape folders (benchmarks.gpu.shapes write); their servers start together")
    parser.add_argument("out", type=Path)
    parser.add_argument("--prompt-lens", default=",".join(map(str, PROMPT_LENS)))
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    parser.add_argument("--run-timeout-s", type=float, default=RUN_TIMEOUT_S)
    parser.add_argument("--dry-run", action="store_true",
                        help="write OUT/commands-bench-<shape>.json and plan-bench-<shape>.json only")
    args = parser.parse_args(argv)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    memory, gpu = gpu_bytes()
    try:
        benches = [Bench(model_dir, args, memory, gpu) for model_dir in args.model_dirs]
    except shapes.ShapeDoesNotFit as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    together = sum(2 * bench.plan["memory_share"] for bench in benches)
    if together > shapes.TWO_SERVERS_SHARE:
        names = ", ".join(bench.shape.name for bench in benches)
        print(f"error: the servers of {names} ask for {together:.2f} of the GPU together, over "
              f"{shapes.TWO_SERVERS_SHARE}: bench them in separate stages", file=sys.stderr)
        return 1
    if args.dry_run:
        for bench in benches:
            bench.write_commands()
        return 0
    # The job's `timeout` ends a stage with SIGTERM: exit through the stack, so that the servers stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    current = benches[0]
    try:
        with ExitStack() as stack:
            start_all(stack, [server for bench in benches for server in bench.roles.values()])
            for bench in benches:
                bench.result["startup_s"] = round(time.monotonic() - started, 1)
            for current in benches:
                current.run()
    except (Exception, SystemExit) as error:  # noqa: BLE001 - recorded with what ran
        current.result["error"] = f"{type(error).__name__}: {error}"
    for bench in benches:
        bench.write()
        print(markdown(bench.result))
    return 0 if all(bench.ok for bench in benches) else 1


if __name__ == "__main__":
    sys.exit(main())
