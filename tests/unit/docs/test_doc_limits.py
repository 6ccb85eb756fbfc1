"""The docs stay readable: no page in docs/ over ``DOC_LINES`` lines, the README at most ``README_LINES``
lines with none over ``LINE_CHARS`` characters outside code blocks and tables, and docs/benchmarks.md's
current-results table at most ``RESULT_ROWS`` rows of short cells (workload, vanilla, eviction, ×, run).
docs/history/ is left out: its files are earlier text kept unchanged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
DOC_LINES = 400
README_LINES = 100
LINE_CHARS = 120
RESULT_ROWS = 12
#: characters a cell of the current-results table may show (link targets not counted)
CELL_CHARS = 80
RESULT_COLUMNS = ["workload", "vanilla", "eviction", "×", "run"]
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def long_prose_lines(text: str, limit: int = LINE_CHARS) -> list[str]:
    """``N: length`` for each line over ``limit`` characters outside fenced code blocks and table rows."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and not line.lstrip().startswith("|") and len(line) > limit:
            found.append(f"{number}: {len(line)}")
    return found


def shown(cell: str) -> str:
    """A markdown cell as the reader sees it: link targets dropped."""
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell).strip()


def current_results(text: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the first table under "## Current results", cells as shown."""
    lines = text[text.index("\n## Current results\n") :].splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("|"))
    end = next((n for n in range(start, len(lines)) if not lines[n].startswith("|")), len(lines))
    table = [[shown(cell) for cell in line.strip().strip("|").split("|")] for line in lines[start:end]]
    return table[0], table[2:]


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_no_doc_is_over_the_line_limit(doc):
    assert len(doc.read_text().splitlines()) <= DOC_LINES


def test_the_readme_fits_its_limits():
    text = README.read_text()
    assert len(text.splitlines()) <= README_LINES
    assert long_prose_lines(text) == []


def test_the_current_results_table_is_short():
    header, rows = current_results(BENCHMARKS.read_text())
    assert header == RESULT_COLUMNS
    assert 0 < len(rows) <= RESULT_ROWS
    assert [cell for row in rows for cell in row if len(cell) > CELL_CHARS] == []
    assert all(len(row) == len(RESULT_COLUMNS) for row in rows)


def test_a_long_line_and_a_long_table_fail():
    """The checks themselves: a prose line over the limit is found, a code line and a table row are not;
    a table one row too long, or with a run-log cell, is found."""
    text = "x" * 121 + "\n```\n" + "y" * 200 + "\n```\n| " + "z" * 200 + " |\n"
    assert long_prose_lines(text) == ["1: 121"]
    text = BENCHMARKS.read_text()
    rows = current_results(text)[1]
    first_row = text.index("\n", text.index("|---", text.index("| workload |"))) + 1
    row = "| " + " | ".join(["a"] * len(RESULT_COLUMNS)) + " |\n"
    longer = text[:first_row] + row * (RESULT_ROWS + 1 - len(rows)) + text[first_row:]
    assert len(current_results(longer)[1]) == RESULT_ROWS + 1
    wide = text[:first_row] + "| " + "w" * (CELL_CHARS + 1) + " | 1 | 2 | 3 | x |\n" + text[first_row:]
    assert [len(cell) for row in current_results(wide)[1] for cell in row if len(cell) > CELL_CHARS] == [
        CELL_CHARS + 1
    ]
