"""Every relative link in README.md, CONTRIBUTING.md, docs/*.md and benchmarks/gpu/README.md points to a
file that exists, and every ``#anchor`` to a heading of its target, by GitHub's heading-slug rule.
docs/history/ is left out: its files are earlier text kept unchanged, links included."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
#: The pages a reader starts from: the README, CONTRIBUTING, the docs (not docs/history/, kept as it was
#: written) and the GPU job's notes.
PAGES = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "benchmarks" / "gpu" / "README.md",
]

#: ``[text](target)`` and ``![alt](target)``; the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
FENCE = re.compile(r"^ {0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text (links and emphasis markers dropped, inline
    code kept as its content), lower-cased, every character that is not a letter, digit, space, ``-`` or
    ``_`` removed, spaces turned into ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = INLINE_CODE.sub(lambda m: m.group(2), text)
    text = re.sub(r"\*+", "", text)
    kept = "".join(c for c in text.strip().lower() if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a page offers: its headings' slugs (a repeated slug gets ``-1``, ``-2``, ... as on GitHub)
    and the names of explicit HTML anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(page.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """The link targets of a page that are neither URLs nor mail addresses, outside code."""
    targets = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                targets.append(target)
    return targets


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """``target: why`` for each relative link of ``page`` whose file or anchor does not exist (paths in the
    message relative to ``root``)."""
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        shown = dest.relative_to(root) if dest.is_relative_to(root) else dest
        if not dest.exists():
            broken.append(f"{target}: no file {shown}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {shown}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_and_anchor_exists(page: Path) -> None:
    assert broken_links(page) == []


def test_the_pages_have_links_to_check() -> None:
    """The parser finds the README's links to its runs (a parser that finds nothing would pass every page)."""
    targets = relative_links(REPO / "README.md")
    assert any("#" in t and t.startswith("docs/benchmarks.md") for t in targets)
    assert any("#" in t and t.startswith("docs/question_first.md") for t in targets)


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        (
            "Capacity of the served default, both servers compiled — run of 2026-11-27 11:38 UTC",
            "capacity-of-the-served-default-both-servers-compiled--run-of-2026-11-27-1138-utc",
        ),
        (
            "Short own parts kept whole (`min_freed_share`) — runs of 2026-11-29 01:50 to 03:14 UTC",
            "short-own-parts-kept-whole-min_freed_share--runs-of-2026-11-29-0150-to-0314-utc",
        ),
        (
            "Compaction bandwidth (target ≥ 70 % of a device copy measured in the same run)",
            "compaction-bandwidth-target--70--of-a-device-copy-measured-in-the-same-run",
        ),
        ("Latest `eval --compare` run", "latest-eval---compare-run"),
        ("**Bold** and [a link](x.md)", "bold-and-a-link"),
    ],
)
def test_slug_follows_githubs_rule(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_a_broken_anchor_and_a_missing_file_are_reported(tmp_path: Path) -> None:
    (tmp_path / "target.md").write_text("# A heading\n\n## A heading\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](target.md#a-heading) [repeat](target.md#a-heading-1) [self](#title)\n"
        "[bad anchor](target.md#not-a-heading) [gone](missing.md) `[code](missing.md)` [web](https://x.org/a)\n"
        "# Title\n"
    )
    assert broken_links(page, root=tmp_path.resolve()) == [
        "target.md#not-a-heading: no heading with anchor #not-a-heading in target.md",
        "missing.md: no file missing.md",
    ]
