"""Tables and plot of the needle benchmark: ``docs/policies.md`` (between its results markers) and
``docs/img/policies_needle.png``.

    .venv/bin/python benchmarks/policy_quality/report.py docs/results/policy-quality/results-*.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "policies.md"
PLOT = ROOT / "docs" / "img" / "policies_needle.png"
START, END = "<!-- results:start -->", "<!-- results:end -->"
MODES = ("question-aware", "question-agnostic")


def load(paths: list[Path]) -> list[dict]:
    return [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]


def label(record: dict) -> str:
    if record["side"] == "full":
        return "full cache"
    return record["method"] if record["side"] == "ours" else f"kvpress {record['method']}"


def accuracy_cells(records: list[dict]) -> dict:
    """{(mode, label, fraction, length): [correct, total]} over samples; rows with errors are skipped."""
    cells: dict = defaultdict(lambda: [0, 0])
    for r in records:
        if "correct" not in r:
            continue
        cell = cells[(r["mode"], label(r), r["kept_fraction"], r["length"])]
        cell[0] += int(r["correct"])
        cell[1] += 1
    return cells


def ordered_labels(records: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for side in ("full", "ours", "kvpress"):
        for r in records:
            if r["side"] == side:
                seen.setdefault(label(r), None)
    return list(seen)


def table(records: list[dict], cells: dict, mode: str) -> str:
    lengths = sorted({r["length"] for r in records})
    fractions = sorted({r["kept_fraction"] for r in records if r["side"] != "full"}, reverse=True)
    header = ["method"] + [f"{int(f * 100)}% @ {length // 1024}k" for f in fractions for length in lengths]
    header.append("mean")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    errors = {(r["mode"], label(r), r["kept_fraction"]): r["error"] for r in records if "error" in r}
    for name in ordered_labels(records):
        row, total = [name], [0, 0]
        for fraction in fractions:
            for length in lengths:
                key = (mode, name, 1.0 if name == "full cache" else fraction, length)
                correct, count = cells.get(key, (0, 0))
                if count:
                    row.append(f"{correct}/{count}")
                    total[0] += correct
                    total[1] += count
                else:
                    row.append("n/a" if (mode, name, fraction) in errors else "-")
        row.append(f"{100 * total[0] / total[1]:.0f}%" if total[1] else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def ada_vs_snap(cells: dict) -> str:
    """How often Ada-SnapKV >= SnapKV, per (mode, fraction, length) cell, ours and kvpress."""
    lines = []
    for prefix in ("", "kvpress "):
        wins = ties = losses = 0
        for (mode, name, fraction, length), (correct, count) in cells.items():
            if name != f"{prefix}snapkv":
                continue
            ada = cells.get((mode, f"{prefix}ada-snapkv", fraction, length))
            if not ada or not count:
                continue
            diff = ada[0] / ada[1] - correct / count
            wins, ties, losses = wins + (diff > 0), ties + (diff == 0), losses + (diff < 0)
        side = "kvpress" if prefix else "ours"
        lines.append(
            f"- {side}: Ada-SnapKV better in {wins}, equal in {ties}, worse in {losses} of "
            f"{wins + ties + losses} cells"
        )
    return "\n".join(lines)


def plot(records: list[dict], cells: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(13, 6), sharey=True)
    fractions = sorted({r["kept_fraction"] for r in records if r["side"] != "full"})
    # One colour per method: ours solid, kvpress's press of the same method dashed in the same colour.
    methods = list(dict.fromkeys(r["method"] for r in records if r["side"] != "full"))
    colours = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)}
    for ax, mode in zip(axes, MODES, strict=True):
        for name in ordered_labels(records):
            if name == "full cache":
                continue
            xs, ys = [], []
            for fraction in fractions:
                hits = [c for k, c in cells.items() if k[0] == mode and k[1] == name and k[2] == fraction]
                count = sum(c[1] for c in hits)
                if count:
                    xs.append(fraction)
                    ys.append(100 * sum(c[0] for c in hits) / count)
            style = "--" if name.startswith("kvpress") else "-"
            colour = colours[name.removeprefix("kvpress ")]
            ax.plot(xs, ys, style, marker="o", color=colour, label=name)
        full = [c for k, c in cells.items() if k[0] == mode and k[1] == "full cache"]
        if full:
            ax.axhline(
                100 * sum(c[0] for c in full) / sum(c[1] for c in full),
                color="k",
                lw=0.8,
                ls=":",
                label="full cache",
            )
        ax.set_xscale("log")
        ax.set_xticks(fractions, [f"{int(f * 100)}%" for f in fractions])
        ax.minorticks_off()
        ax.set_xlabel("kept fraction of the prompt (per KV head, average)")
        ax.set_title(f"needle retrieval, {mode}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy over lengths and samples (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, ncol=6, loc="lower center")
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def results_section(records: list[dict], cells: dict) -> str:
    lengths = sorted({r["length"] for r in records})
    samples = defaultdict(set)
    for r in records:
        samples[r["length"]].add(r["sample"])
    counts = ", ".join(f"{length // 1024}k: {len(samples[length])}" for length in lengths)
    parts = [
        f"Samples per length: {counts}. Cells are correct/samples.",
        "",
        f"![needle accuracy vs kept fraction]({PLOT.relative_to(DOC.parent)})",
        "",
    ]
    for mode in MODES:
        parts += [f"### {mode}", "", table(records, cells, mode), ""]
    parts += ["### Ada-SnapKV vs SnapKV, cell by cell", "", ada_vs_snap(cells), ""]
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+")
    args = parser.parse_args()
    records = load(args.results)
    cells = accuracy_cells(records)
    plot(records, cells, PLOT)
    doc = DOC.read_text()
    if START not in doc or END not in doc:
        raise SystemExit(f"{DOC} lacks the {START} / {END} markers")
    before, rest = doc.split(START, 1)
    _, after = rest.split(END, 1)
    DOC.write_text(f"{before}{START}\n{results_section(records, cells)}\n{END}{after}")
    print(f"wrote {DOC} and {PLOT}")


if __name__ == "__main__":
    main()
