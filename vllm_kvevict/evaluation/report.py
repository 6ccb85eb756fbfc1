"""The measured part of ``docs/quality.md``: tables of a comparison, written between two markers so that the
hand-written parts of the page (task descriptions, analysis) survive a re-run."""

from __future__ import annotations

import os
import platform
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllm_kvevict.evaluation.configs import EvalConfig
from vllm_kvevict.evaluation.results import Result, overall_score

BEGIN = "<!-- measured results: begin (written by `vllm-kvevict eval --compare`) -->"
END = "<!-- measured results: end -->"


def per_task_scores(results: Sequence[Result]) -> dict[str, float]:
    cells: dict[str, list[float]] = defaultdict(list)
    for result in results:
        if result.score is not None:
            cells[result.task].append(result.score)
    return {task: sum(v) / len(v) for task, v in cells.items()}


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores visible, {platform.system()} {platform.release()}, no GPU"


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def overall_table(results: Mapping[EvalConfig, Sequence[Result]]) -> str:
    """Rows: method per system/mode; columns: kept fractions; cells: mean accuracy over tasks (percent)."""
    kept = sorted({c.kept for c in results}, reverse=True)
    rows: dict[tuple[str, str, str], dict[float, float | None]] = defaultdict(dict)
    for config, config_results in results.items():
        system = "ours (vLLM)" if config.system == "vllm" else f"kvpress ({config.mode})"
        method = "full cache" if config.is_full_cache else config.method
        rows[(method, system, config.mode)][config.kept] = overall_score(config_results)
    lines = [
        "| method | implementation | " + " | ".join(f"kept {k:g}" for k in kept) + " |",
        "|---|---|" + "---:|" * len(kept),
    ]
    for (method, system, _), cells in sorted(rows.items(), key=lambda kv: (kv[0][0] != "full cache", kv[0])):
        lines.append(f"| {method} | {system} | " + " | ".join(_fmt(cells.get(k)) for k in kept) + " |")
    return "\n".join(lines)


def task_table(results: Mapping[EvalConfig, Sequence[Result]]) -> str:
    """Rows: configurations; columns: tasks; cells: mean accuracy (percent)."""
    scores = {c: per_task_scores(r) for c, r in results.items()}
    tasks = sorted({t for s in scores.values() for t in s})
    lines = ["| configuration | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
    for config in sorted(scores, key=lambda c: (c.system, c.method, c.mode, -c.kept)):
        lines.append(f"| {config.name} | " + " | ".join(_fmt(scores[config].get(t)) for t in tasks) + " |")
    return "\n".join(lines)


def evidence_table(evidence: Mapping[str, Mapping[str, float]]) -> str:
    """What each vLLM server's ``vllm_kvevict_*`` counters said after answering: proof that it evicted."""
    lines = [
        "Eviction counters read from each vLLM server's `/metrics` after its run (kept fraction = kept / "
        "(kept + evicted) prompt tokens per KV head, summed over requests):",
        "",
        "| server | requests compacted | requests skipped | measured kept fraction | blocks freed |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, counters in sorted(evidence.items()):
        if not counters:
            lines.append(f"| {name} | – | – | – | – |")
            continue
        kept, evicted = counters.get("tokens_kept", 0.0), counters.get("tokens_evicted", 0.0)
        fraction = f"{kept / (kept + evicted):.3f}" if kept + evicted else "–"
        lines.append(
            f"| {name} | {counters.get('requests_compacted', 0):g} | "
            f"{counters.get('requests_skipped', 0):g} | {fraction} | {counters.get('blocks_freed', 0):g} |"
        )
    return "\n".join(lines)


def results_section(
    results: Mapping[EvalConfig, Sequence[Result]],
    command: str,
    sample_summary: str,
    failures: Mapping[str, str],
    plot_paths: Sequence[str],
    evidence: Mapping[str, Mapping[str, float]] | None = None,
    servers: str | None = None,
) -> str:
    """The measured section: setting (``servers``: how every server ran, compiled or eager), overall table,
    per-task table, plots, failures, token agreement."""
    mismatched = sum(
        1
        for rs in results.values()
        for r in rs
        if r.served_prompt_tokens is not None and r.served_prompt_tokens != r.prompt_tokens
    )
    total = sum(len(rs) for rs in results.values())
    parts = [
        BEGIN,
        "",
        f"Machine: {machine_description()}.",
        "",
        f"Samples: {sample_summary}.",
        "",
        *([f"Servers: {servers}.", ""] if servers else []),
        "Command:",
        "",
        "```bash",
        command,
        "```",
        "",
        "### Accuracy (%), mean over tasks",
        "",
        overall_table(results),
        "",
        *[f"![{Path(p).stem}]({p})" for p in plot_paths],
        "",
        "### Accuracy (%) per task",
        "",
        task_table(results),
        "",
        f"Prompt-length agreement: {total - mismatched} of {total} answered prompts had exactly the token "
        "count the generator measured (server `usage.prompt_tokens`, or the kvpress token ids).",
    ]
    if evidence:
        parts += ["", evidence_table(evidence)]
    if failures:
        parts += ["", "Configurations that could not run:", ""]
        parts += [f"- `{name}`: {reason}" for name, reason in sorted(failures.items())]
    parts += ["", END]
    return "\n".join(parts)


def write_section(path: Path, section: str, skeleton: str) -> None:
    """Replace the measured section of ``path`` (or create the page from ``skeleton`` around it)."""
    text = path.read_text() if path.exists() else skeleton
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        text = head + section + tail
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
