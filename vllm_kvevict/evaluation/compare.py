"""``vllm-kvevict eval --compare``: the same samples through vanilla vLLM, one vLLM server per eviction
method x budget, and kvpress presses; then the report and plots.

Every configuration writes ``RESULTS_DIR/<config>.jsonl``; a complete file is reused, so an interrupted
comparison resumes where it stopped and ``--report-only`` rebuilds the page from what is there.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections import Counter
from pathlib import Path

from vllm_kvevict.evaluation.configs import EvalConfig
from vllm_kvevict.evaluation.kvpress_bridge import kvpress_configs, run_kvpress, score_raw
from vllm_kvevict.evaluation.plots import plot_accuracy_vs_kept, plot_task_heatmap
from vllm_kvevict.evaluation.report import per_task_scores, results_section, write_section
from vllm_kvevict.evaluation.results import Result, overall_score, read_results, summary_table, write_results
from vllm_kvevict.evaluation.runner import make_client, run_samples
from vllm_kvevict.evaluation.sample import Sample, read_samples, write_samples
from vllm_kvevict.server_process import server_mode_text

SKELETON = """# Answer quality under KV eviction

Measured by `vllm-kvevict eval --compare`; see the sections below for the tasks and how they are scored.
"""
FAILURES_FILE = "failures.json"
EVIDENCE_FILE = "server-metrics.json"
EVICTION_COUNTERS = (
    "requests_compacted",
    "requests_skipped",
    "tokens_kept",
    "tokens_evicted",
    "blocks_freed",
)


def server_configs(methods: list[str], budgets: list[float]) -> list[EvalConfig]:
    """Vanilla vLLM plus one server per method x kept fraction."""
    return [EvalConfig("vllm", "vanilla", 1.0)] + [EvalConfig("vllm", m, b) for m in methods for b in budgets]


def _complete(path: Path, samples: list[Sample]) -> bool:
    if not path.exists():
        return False
    results = read_results(path)
    return {r.sample_id for r in results} == {s.id for s in samples} and not any(r.error for r in results)


def _same_samples(path: Path, samples: list[Sample]) -> None:
    """Refuse to mix results of other samples into this directory."""
    if path.exists() and read_samples(path) != samples:
        raise ValueError(
            f"{path} holds other samples (different tasks, lengths, counts or seed); "
            "use another --results-dir or remove it"
        )


def eviction_evidence(metrics_text: str) -> dict[str, float]:
    """Totals of the plugin's ``vllm_kvevict_*`` counters on a server's ``/metrics`` (empty: none exported),
    so the report shows that an eviction server really evicted."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removeprefix("vllm_kvevict_").removesuffix("_total")
            if sample.name.startswith("vllm_kvevict_") and name in EVICTION_COUNTERS:
                totals[name] = totals.get(name, 0.0) + float(sample.value)
    return totals


def server_args(config: EvalConfig, block_size: int, kv_cache_dtype: str = "auto") -> tuple[str, ...]:
    """``vllm serve`` arguments of a configuration: every server (vanilla too) gets the same block size,
    since eviction frees whole blocks and rounds a kept fraction up to them, and the same
    ``--kv-cache-dtype`` (an fp8 vanilla is the baseline of fp8 with eviction)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")
    args: tuple[str, ...] = ("--block-size", str(block_size))
    if kv_cache_dtype != "auto":
        args += ("--kv-cache-dtype", kv_cache_dtype)
    if not config.is_full_cache:
        args += ("--kv-eviction", config.method, "--kv-budget", f"{config.kept:g}")
    return args


def run_server_config(
    config: EvalConfig, samples: list[Sample], model_dir: Path, args: argparse.Namespace, log_dir: Path
) -> tuple[list[Result], dict[str, float]]:
    """Start the server of ``config``, answer every sample, read its eviction counters, stop it."""
    from vllm_kvevict.server_process import VLLMServer, startup_timeout_for

    with VLLMServer(
        model_dir,
        extra_args=server_args(config, args.block_size, args.kv_cache_dtype),
        kv_cache_space_gib=args.kv_cache_space_gib,
        enforce_eager=args.eager,
        startup_timeout_s=startup_timeout_for(args.eager),
        log_path=log_dir / f"{config.name}.log",
    ) as server:
        client = make_client(server.base_url)
        results = run_samples(
            client,
            server.served_model_name,
            samples,
            config.name,
            concurrency=args.concurrency,
            progress=not args.no_progress,
        )
        return results, eviction_evidence(server.metrics_text())


def load_results(results_dir: Path) -> dict[EvalConfig, list[Result]]:
    """Every configuration's results found in ``results_dir``."""
    found = {}
    for path in sorted(results_dir.glob("*.jsonl")):
        if path.name != "samples.jsonl":
            found[EvalConfig.parse(path.stem)] = read_results(path)
    return found


def _sample_summary(samples: list[Sample]) -> str:
    tasks = Counter(s.task for s in samples)
    lengths = sorted({s.target_tokens for s in samples})
    per_cell = len(samples) // max(1, len(tasks) * len(lengths))
    return (
        f"{len(samples)} prompts = {len(tasks)} tasks ({', '.join(sorted(tasks))}) x lengths "
        f"{', '.join(map(str, lengths))} tokens x {per_cell} samples (seeded by --seed, see the command)"
    )


def score_kvpress_outputs(results_dir: Path, samples: list[Sample]) -> None:
    """Score every complete kvpress output in ``RESULTS_DIR/kvpress-raw`` into a results file."""
    for raw in sorted((results_dir / "kvpress-raw").glob("*.raw.jsonl")):
        name = raw.name.removesuffix(".raw.jsonl")
        write_results(results_dir / f"{name}.jsonl", score_raw(raw, samples))


def write_report(results_dir: Path, report: Path, plots_dir: Path, command: str, servers: str) -> None:
    """Tables into ``report`` and PNG plots into ``plots_dir`` from the results in ``results_dir``
    (kvpress outputs are scored first)."""
    score_kvpress_outputs(results_dir, read_samples(results_dir / "samples.jsonl"))
    results = load_results(results_dir)
    if not results:
        raise FileNotFoundError(f"no results in {results_dir}")
    samples = read_samples(results_dir / "samples.jsonl")
    failures_path = results_dir / FAILURES_FILE
    failures = json.loads(failures_path.read_text()) if failures_path.exists() else {}
    evidence_path = results_dir / EVIDENCE_FILE
    evidence = json.loads(evidence_path.read_text()) if evidence_path.exists() else {}
    overall = {c: v for c, r in results.items() if (v := overall_score(r)) is not None}
    plots_dir.mkdir(parents=True, exist_ok=True)
    curve, heatmap = plots_dir / "quality_vs_kept.png", plots_dir / "quality_tasks_heatmap.png"
    plot_accuracy_vs_kept(overall, curve)
    plot_task_heatmap({c: per_task_scores(r) for c, r in results.items()}, heatmap)
    relative = [os.path.relpath(p.resolve(), report.resolve().parent) for p in (curve, heatmap)]
    section = results_section(
        results, command, _sample_summary(samples), failures, relative, evidence, servers=servers
    )
    write_section(report, section, SKELETON)


def run_compare(args: argparse.Namespace, samples: list[Sample], model_dir: Path) -> int:
    """Run every configuration not yet complete, then write the report; 1 if any configuration failed."""
    results_dir: Path = args.results_dir
    results_dir.mkdir(parents=True, exist_ok=True)
    command = "vllm-kvevict " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    servers = server_mode_text(args.eager)
    print(f"servers: {servers}", file=sys.stderr)
    if args.report_only:
        write_report(results_dir, args.report, args.plots_dir, command, servers)
        return 0
    samples_path = results_dir / "samples.jsonl"
    _same_samples(samples_path, samples)
    write_samples(samples_path, samples)
    failures_path = results_dir / FAILURES_FILE
    failures: dict[str, str] = json.loads(failures_path.read_text()) if failures_path.exists() else {}
    evidence_path = results_dir / EVIDENCE_FILE
    evidence = json.loads(evidence_path.read_text()) if evidence_path.exists() else {}
    for config in server_configs(args.methods, args.budgets):
        path = results_dir / f"{config.name}.jsonl"
        if _complete(path, samples):
            print(f"{config.name}: complete, reused", file=sys.stderr)
            continue
        try:
            results, evidence[config.name] = run_server_config(config, samples, model_dir, args, results_dir)
        except Exception as exc:  # noqa: BLE001 - one configuration failing must not lose the others
            failures[config.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            print(f"{config.name}: FAILED: {failures[config.name]}", file=sys.stderr)
            failures_path.write_text(json.dumps(failures, indent=1))
            continue
        failures.pop(config.name, None)
        write_results(path, results)
        evidence_path.write_text(json.dumps(evidence, indent=1))
        print(f"\n{config.name}\n{summary_table(results)}\n", file=sys.stderr)
    if args.kvpress:
        configs = kvpress_configs(args.kvpress, args.budgets, args.kvpress_modes)
        try:
            run_kvpress(args.kvpress_python, model_dir, samples_path, results_dir / "kvpress-raw", configs)
        except Exception as exc:  # noqa: BLE001 - keep whatever the script finished
            failures["kvpress"] = f"{type(exc).__name__}: {exc}"
    failures_path.write_text(json.dumps(failures, indent=1))
    write_report(results_dir, args.report, args.plots_dir, command, servers)
    print(f"report written to {args.report}", file=sys.stderr)
    return 1 if failures else 0
