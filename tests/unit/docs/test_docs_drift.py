"""What the docs say against what the code has, for the kinds of drift a method list does not cover:

- the metrics table of docs/observability.md against the metrics ``EvictionMetrics`` registers (names as
  Prometheus exposes them, type, labels);
- the config keys of docs/usage.md's tables and the values each offers against the settings' parsers
  (``PREFILL_KEYS``, ``PREFILL_MODES``, ``BETWEEN_KINDS``, ``BETWEEN_SCORERS``, ``OVERRIDE_KEYS``,
  ``CONTEXT_VALUES``, ``DECODE_ALLOCATIONS``);
- a measured figure that belongs to one page (``OWNED_FIGURES``) stated only there; other pages link to it;
- the served command of ``make serve``, compose and Kubernetes: the same budget and block size as the
  Makefile's, which the README's ``make serve`` line names.

Every expected value is read from the code or the Makefile, never listed here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from vllm_kvevict.metrics import EvictionMetrics
from vllm_kvevict.policies.between_chunks import BETWEEN_KINDS, BETWEEN_SCORERS
from vllm_kvevict.settings.config import PREFILL_KEYS, PREFILL_MODES
from vllm_kvevict.settings.decode_config import DECODE_ALLOCATIONS
from vllm_kvevict.settings.request_settings import CONTEXT_VALUES, OVERRIDE_KEYS, PREFILL_KEY

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
OBSERVABILITY = DOCS / "observability.md"
USAGE = DOCS / "usage.md"
#: the pages a reader opens (docs/history/ keeps earlier text unchanged)
PAGES = (ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md")))
BACKTICKED = re.compile(r"`([^`\n]+)`")
QUOTED_VALUE = re.compile(r'`"([a-z][a-z0-9-]*)"`')


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the table whose header row starts with ``header`` (the first such table)."""
    start = text.index(header)
    end = text.find("\n\n", start)
    lines = text[start : end if end >= 0 else len(text)].splitlines()[2:]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


# --- metrics -------------------------------------------------------------------------------------------

TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram"}


def registered_metrics() -> dict[str, tuple[str, set[str]]]:
    """{name as /metrics shows it: (type, labels)} of every metric ``EvictionMetrics`` registers; a counter
    is exposed with ``_total``."""
    registry = CollectorRegistry()
    EvictionMetrics(registry)
    found = {}
    for name, collector in registry._names_to_collectors.items():  # every name a collector registered
        kind = collector._type
        base = re.sub(r"_(created|total|sum|count|bucket)$", "", name)
        exposed = base + "_total" if kind == "counter" else base
        found[exposed] = (kind, set(collector._labelnames))
    return found


def documented_metrics(text: str) -> dict[str, tuple[str, set[str]]]:
    """{metric: (type, labels)} of observability.md's metrics table."""
    documented = {}
    for cells in table_rows(text, "| metric | type | labels | meaning |"):
        name = BACKTICKED.findall(cells[0])[0]
        kind = next((word for word in TYPES if cells[1].startswith(word)), cells[1])
        documented[name] = (kind, set(BACKTICKED.findall(cells[2])))
    return documented


def test_the_metrics_table_is_every_registered_metric_with_its_type_and_labels():
    assert documented_metrics(OBSERVABILITY.read_text()) == registered_metrics()


def test_a_renamed_or_missing_metric_fails_the_table():
    """The check itself: a metric renamed in the table, and a row removed."""
    text = OBSERVABILITY.read_text()
    metric = "vllm_kvevict_decode_blocks_freed_total"
    renamed = text.replace(f"`{metric}`", "`vllm_kvevict_decode_blocks_total`", 1)
    assert renamed != text
    assert documented_metrics(renamed) != registered_metrics()
    removed = re.sub(r"^\| `vllm_kvevict_worker_requests` \|.*\n", "", text, count=1, flags=re.M)
    assert "vllm_kvevict_worker_requests" not in documented_metrics(removed)


# --- config keys and their values ----------------------------------------------------------------------


def key_rows(text: str, header: str = "| key | meaning |") -> dict[str, str]:
    """{key: its row's text} of the table with ``header``."""
    return {BACKTICKED.findall(cells[0])[0]: cells[1] for cells in table_rows(text, header)}


def usage_text() -> str:
    """usage.md and the pages it splits off (usage_*.md), where the keys beyond the schedule table live."""
    return "\n".join(path.read_text() for path in (USAGE, *sorted(DOCS.glob("usage_*.md"))))


#: each key whose value is one of a parser's choices: the row that lists them, and the choices
SCHEDULE_CHOICES = {
    "prefill": PREFILL_MODES,
    "between": BETWEEN_KINDS,
    "between_scorer": tuple(BETWEEN_SCORERS),
}
REQUEST_CHOICES = {PREFILL_KEY: PREFILL_MODES, "kv_context": CONTEXT_VALUES}


def choice_problems(rows: dict[str, str], choices: dict[str, tuple[str, ...]]) -> list[str]:
    """Each row that leaves out one of its key's choices, or quotes a value no key of the table takes."""
    takes = {value for values in choices.values() for value in values}
    problems = []
    for key, values in choices.items():
        quoted = QUOTED_VALUE.findall(rows.get(key, ""))
        problems += [f"{key}: {value!r} not listed" for value in values if value not in quoted]
        problems += [f"{key}: {value!r} is no choice" for value in quoted if value not in takes]
    return problems


def test_the_prompt_schedule_table_names_only_keys_the_parser_takes():
    rows = key_rows(USAGE.read_text())
    assert sorted(set(rows) - set(PREFILL_KEYS)) == []


def test_usage_documents_every_key_of_the_prompt_schedule():
    text = usage_text()
    assert [key for key in PREFILL_KEYS if f"`{key}`" not in text] == []


def test_the_schedule_rows_list_every_choice_of_their_parser():
    assert choice_problems(key_rows(USAGE.read_text()), SCHEDULE_CHOICES) == []


def test_the_per_request_table_is_every_key_and_choice_the_validator_takes():
    rows = key_rows(USAGE.read_text(), "| key | value |")
    assert sorted(rows) == sorted(OVERRIDE_KEYS)
    assert choice_problems(rows, REQUEST_CHOICES) == []


def test_the_decode_allocation_row_lists_its_choices():
    row = re.search(r"^\| `--kv-decode-allocation ([^`]+)` \|", USAGE.read_text(), re.M)
    assert row, "usage.md has no --kv-decode-allocation row"
    assert row.group(1).replace("\\|", "|").split("|") == list(DECODE_ALLOCATIONS)


def test_a_choice_left_out_of_a_row_fails():
    """The check itself: ``expected-attention`` dropped from the ``between`` row, a stale value added."""
    rows = key_rows(USAGE.read_text())
    planted = {**rows, "between": rows["between"].replace('`"expected-attention"`', "")}
    assert choice_problems(planted, SCHEDULE_CHOICES) == ["between: 'expected-attention' not listed"]
    stale = {**rows, "prefill": rows["prefill"] + ' or `"eager"`'}
    assert choice_problems(stale, SCHEDULE_CHOICES) == ["prefill: 'eager' is no choice"]


# --- a figure stated once ------------------------------------------------------------------------------

#: figures stated in one page only, the others link there: what the figure is -> (how a sentence states it,
#: the page that owns it)
OWNED_FIGURES = {
    "the question echo's cost in time to the first token": (
        re.compile(r"\d+(?:\.\d+)?\s?% of (?:vanilla's |the )?(?:TTFT|time to (?:the )?first token)"),
        DOCS / "question_first.md",
    ),
}


def pages_stating(pattern: re.Pattern[str], pages: tuple[Path, ...] = PAGES) -> list[str]:
    return [page.name for page in pages if pattern.search(" ".join(page.read_text().split()))]


@pytest.mark.parametrize("figure", OWNED_FIGURES)
def test_a_figure_is_stated_once_by_the_page_that_owns_it(figure):
    pattern, owner = OWNED_FIGURES[figure]
    assert pages_stating(pattern) == [owner.name]


def test_a_figure_restated_elsewhere_fails(tmp_path):
    """The check itself: a page that states the echo's cost again."""
    pattern, owner = OWNED_FIGURES["the question echo's cost in time to the first token"]
    copy = tmp_path / "usage.md"
    copy.write_text(USAGE.read_text() + "\nThe echo costs ~9 % of vanilla's time to the first token.\n")
    assert pages_stating(pattern, (owner, copy)) == [owner.name, "usage.md"]


# --- the served commands -------------------------------------------------------------------------------


def makefile_default(name: str) -> str:
    found = re.search(rf"^{name} \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert found, f"the Makefile sets no {name}"
    return found.group(1)


def flag_values(args: list[str], flag: str) -> list[str]:
    """The values of ``--flag=VALUE`` in a container's args (``${VAR:-default}`` read as its default)."""
    values = [arg.split("=", 1)[1] for arg in args if isinstance(arg, str) and arg.startswith(flag + "=")]
    return [re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", value) for value in values]


def served_args() -> dict[str, list[str]]:
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    deployment = next(
        doc for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
        if doc and doc.get("kind") == "Deployment"
    )
    return {
        "compose": compose["services"]["vllm"]["command"],
        "k8s": deployment["spec"]["template"]["spec"]["containers"][0]["args"],
    }


def serve_problems(budget: str, block_size: str, args: dict[str, list[str]], readme: str) -> list[str]:
    problems = [
        f"{where}: {flag}={flag_values(given, flag)}, the Makefile {want}"
        for where, given in args.items()
        for flag, want in (("--kv-budget", budget), ("--block-size", block_size))
        if flag_values(given, flag) != [want]
    ]
    block = readme[readme.index("make serve") :].split("\n\n", 1)[0]  # its comment runs on
    if f"--kv-budget {budget}" not in block or f"{block_size}-token blocks" not in block:
        problems.append(f"README: make serve's lines name no --kv-budget {budget}, {block_size}-token blocks")
    return problems


def test_make_serve_compose_and_k8s_serve_the_same_budget_and_block_size():
    budget, block_size = makefile_default("BUDGET"), makefile_default("BLOCK_SIZE")
    assert serve_problems(budget, block_size, served_args(), (ROOT / "README.md").read_text()) == []


def test_a_served_command_that_differs_fails():
    """The check itself: compose without --block-size, and a Makefile budget the README does not name."""
    budget, block_size = makefile_default("BUDGET"), makefile_default("BLOCK_SIZE")
    args = served_args()
    args["compose"] = [arg for arg in args["compose"] if not str(arg).startswith("--block-size")]
    readme = (ROOT / "README.md").read_text()
    problems = serve_problems(budget, block_size, args, readme)
    assert [problem.split(":")[0] for problem in problems] == ["compose"]
    assert serve_problems("1024", block_size, served_args(), readme) != []
