"""PNG plots of a comparison: accuracy vs kept fraction (a line per method and system), per-task heat map."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from vllm_kvevict.evaluation.configs import EvalConfig

_STYLE = {("vllm", "aware"): "-", ("kvpress", "aware"): "--", ("kvpress", "agnostic"): ":"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy_vs_kept(overall: Mapping[EvalConfig, float], path: Path) -> None:
    """Mean accuracy (percent) against kept fraction; full-cache runs are horizontal reference lines."""
    plt = _pyplot()
    from matplotlib.ticker import NullLocator

    fig, ax = plt.subplots(figsize=(8, 5))
    methods = sorted({c.method for c in overall if not c.is_full_cache})
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    for config, value in overall.items():
        if config.is_full_cache:
            ax.axhline(
                100 * value,
                color="black" if config.system == "vllm" else "grey",
                linestyle=_STYLE[(config.system, config.mode)],
                linewidth=1,
                label=config.line,
            )
    for line in sorted({c.line for c in overall if not c.is_full_cache}):
        points = sorted((c.kept, 100 * v, c) for c, v in overall.items() if c.line == line)
        config = points[0][2]
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            label=line,
            color=colors[config.method],
            linestyle=_STYLE[(config.system, config.mode)],
        )
    ax.set_xscale("log")
    kept = sorted({c.kept for c in overall} | {1.0})
    ax.set_xticks(kept, [f"{k:g}" for k in kept])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("kept fraction of the prompt's KV cache")
    ax.set_ylabel("accuracy (%), mean over tasks")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.set_title(
        "Accuracy vs kept fraction (solid: ours in vLLM, dashed: kvpress aware, dotted: agnostic)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_task_heatmap(per_task: Mapping[EvalConfig, Mapping[str, float]], path: Path) -> None:
    """Accuracy (percent) of every configuration (rows) on every task (columns), annotated."""
    plt = _pyplot()
    configs = sorted(per_task, key=lambda c: (c.system, c.method, c.mode, -c.kept))
    tasks = sorted({t for scores in per_task.values() for t in scores})
    grid = [[100 * per_task[c].get(t, float("nan")) for t in tasks] for c in configs]
    fig, ax = plt.subplots(figsize=(max(6.0, 3.5 + 0.6 * len(tasks)), 2.0 + 0.25 * len(configs)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(configs)), [c.name for c in configs], fontsize=7)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if value == value:  # not NaN
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=6)
    fig.colorbar(image, ax=ax, label="accuracy (%)")
    ax.set_title("Per-task accuracy", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
