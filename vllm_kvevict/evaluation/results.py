"""Per-sample results as JSON lines, and their summary table (accuracy per task and prompt length)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Result:
    """One sample answered by one configuration (a server, or a kvpress press)."""

    config: str
    sample_id: str
    task: str
    target_tokens: int
    prompt_tokens: int
    served_prompt_tokens: int | None
    """``usage.prompt_tokens`` reported by the server; equals ``prompt_tokens`` when tokenizers agree."""
    output: str
    answers: tuple[str, ...]
    score: float | None
    """In [0, 1]; None when the request failed (``error`` says why) - a failure is never scored as 0."""
    latency_s: float
    error: str | None = None

    def to_json(self) -> dict[str, object]:
        record = asdict(self)
        record["answers"] = list(self.answers)
        return record

    @classmethod
    def from_json(cls, record: dict[str, object]) -> Result:
        fields = dict(record)
        fields["answers"] = tuple(fields["answers"])  # type: ignore[arg-type]
        return cls(**fields)  # type: ignore[arg-type]


def write_results(path: str | Path, results: Iterable[Result]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for result in results:
            out.write(json.dumps(result.to_json()) + "\n")


def read_results(path: str | Path) -> list[Result]:
    with open(path, encoding="utf-8") as src:
        return [Result.from_json(json.loads(line)) for line in src if line.strip()]


def mean_scores(results: Iterable[Result]) -> dict[tuple[str, int], float]:
    """Mean score per (task, target length) over the scored results."""
    cells: dict[tuple[str, int], list[float]] = defaultdict(list)
    for result in results:
        if result.score is not None:
            cells[(result.task, result.target_tokens)].append(result.score)
    return {cell: sum(scores) / len(scores) for cell, scores in cells.items()}


def overall_score(results: Iterable[Result]) -> float | None:
    """Mean over tasks of each task's mean score (every task weighs the same whatever its sample count)."""
    per_task: dict[str, list[float]] = defaultdict(list)
    for result in results:
        if result.score is not None:
            per_task[result.task].append(result.score)
    if not per_task:
        return None
    return sum(sum(s) / len(s) for s in per_task.values()) / len(per_task)


def summary_table(results: list[Result]) -> str:
    """A markdown table: one row per task, one column per prompt length, scores in percent."""
    cells = mean_scores(results)
    tasks = sorted({task for task, _ in cells})
    lengths = sorted({length for _, length in cells})
    lines = [
        "| task | " + " | ".join(f"{n} tok" for n in lengths) + " | mean |",
        "|---|" + "---:|" * (len(lengths) + 1),
    ]
    for task in tasks:
        row = [cells.get((task, n)) for n in lengths]
        present = [v for v in row if v is not None]
        values = ["–" if v is None else f"{100 * v:.1f}" for v in row]
        lines.append(f"| {task} | " + " | ".join(values) + f" | {100 * sum(present) / len(present):.1f} |")
    overall = overall_score(results)
    if overall is not None:
        lines.append("| **all tasks** | " + " | ".join("" for _ in lengths) + f" | **{100 * overall:.1f}** |")
    failed = sum(r.error is not None for r in results)
    if failed:
        lines.append(f"\n{failed} of {len(results)} requests failed and are not scored.")
    return "\n".join(lines)
