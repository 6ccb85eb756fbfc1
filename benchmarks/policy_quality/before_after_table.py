"""Markdown table of a ``sweep.py --by-task`` run: one row per method, mean over tasks (%) before and after
span completion at each kept fraction and prompt length.

Variants ``<method>:before`` (``span_after=0``) and ``<method>:after`` (the defaults) fill the two halves;
a variant without that suffix (a method with no ``span_after``: the same selection either way, and
kvpress's presses, which have none) fills both. A cell reads ``mean (tasks)``.

    .venv/bin/python benchmarks/policy_quality/before_after_table.py \
        benchmarks/policy_quality/results-all-methods-1k-4k.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sweep import cell_scores

SIDES = ("before", "after")


def table(records: list[dict]) -> str:
    """Rows: full cache, our methods, then kvpress's presses; columns: (length, side, fraction)."""
    cells = cell_scores(records, by_task=True)
    lengths = sorted({length for _, _, length in cells})
    fractions = sorted({f for _, f, _ in cells if f < 1.0}, reverse=True)
    methods = list(
        dict.fromkeys(
            variant.rsplit(":", 1)[0] if variant.endswith(SIDES) else variant for variant, _, _ in cells
        )
    )
    methods.sort(key=lambda m: (m != "full-cache", m.startswith("kvpress:")))
    header = [
        f"{length // 1024}k {side} {100 * f:g}%" for length in lengths for side in SIDES for f in fractions
    ]
    lines = ["| method | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for method in methods:
        row = []
        for length in lengths:
            for side in SIDES:
                for f in fractions:
                    fraction = 1.0 if method == "full-cache" else f
                    scores = cells.get((f"{method}:{side}", fraction, length)) or cells.get(
                        (method, fraction, length)
                    )
                    row.append(f"{100 * sum(scores) / len(scores):.1f} ({len(scores)})" if scores else "–")
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Before/after span completion table of a sweep JSONL")
    parser.add_argument("results", type=Path)
    args = parser.parse_args()
    print(table([json.loads(line) for line in args.results.read_text().splitlines() if line]))


if __name__ == "__main__":
    main()
