"""The lists the docs give stay true: methods against the policy registry, flags against the real
``vllm serve`` parser, presets against the package data.

Every page (``ALL_DOCS``) is read for method settings, backticked method lists, quoted "invalid choice"
lines (against the parser's choices) and preset names; troubleshooting.md's quoted preset list is the package
data, and policies.md's table and usage.md's decode row name every registered method.

Methods are asked from the registry (``policies.registry.method_names``), never listed here. A doc names
methods in three forms, each checked where it occurs:

- a setting in code (a backtick span or a fenced block): ``--kv-eviction NAME``, ``--kv-decode-eviction
  NAME``, ``"kv_eviction": "NAME"``: NAME is registered (``bogus``, the docs' bad name, excepted);
- a backticked list: ``one of `snapkv, pyramidkv, ...` `` or `` `snapkv`, `h2o`, ... `` (three or more
  registered names in a row): every item is registered (or ``none``);
- a prose list in parentheses of three or more paper names, "(SnapKV, PyramidKV, Ada-KV, ...)": every item
  is a method family of the registry or a registered name ("Ada-SnapKV"). The families come from the
  registry's names: a name that is not a wrapper around another registered name is a family
  (``expected-attention`` -> "Expected Attention"), and a wrapper prefix is one too (``ada-`` -> "Ada-KV",
  ``critical-`` -> "CriticalKV").

Where a doc says what the plugin offers, the list is complete: the largest prose list of README.md and of
pyproject.toml's description names every family (the README is being rewritten: it may name the methods in
one list line only, or in none; what it names must exist), and usage.md's ``--kv-eviction METHOD`` row and
Methods table name every registered method. Other prose lists may be subsets ("the methods that judge by a
window: SnapKV, ...").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from vllm_kvevict.policies.registry import decode_method_names, method_names

ROOT = Path(__file__).resolve().parents[3]
USAGE = ROOT / "docs" / "usage.md"
README = ROOT / "README.md"
#: docs whose method settings and lists are checked (the README and usage.md above all)
CHECKED_DOCS = (
    README,
    USAGE,
    ROOT / "docs" / "troubleshooting.md",
    ROOT / "docs" / "compatibility.md",
    ROOT / "CONTRIBUTING.md",
)
#: every page a reader may open (docs/history/ is earlier text kept unchanged): its method settings and
#: backticked method lists are checked, and the presets it names
ALL_DOCS = (
    README,
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "gpu" / "README.md",
)
PRESETS = ROOT / "vllm_kvevict" / "presets"
#: the docs' example of a method that does not exist (quoted in error lines)
BAD_EXAMPLE = "bogus"
NO_METHOD = "none"
NUMBER_WORDS = {word: n for n, word in enumerate("one two three four five six seven eight nine".split(), 1)}

SETTING = re.compile(
    r"--kv-(?:decode-)?eviction[ =]([a-z0-9][a-z0-9-]*)(?![\w-]|\s+[a-z])"  # not "--kv-eviction is not"
    r"|\"kv_eviction\":\s*\"([a-z0-9-]+)\""
    r"|kv_eviction:\s*\"([a-z0-9-]+)\""
)
BACKTICKED = re.compile(r"`([^`\n]+)`")


def normalized(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def families(names: list[str]) -> set[str]:
    """Method families of registered ``names``, normalized ("adakv", "expectedattention", ...)."""
    found = set()
    for name in names:
        prefix, _, rest = name.partition("-")
        if rest in names:  # a wrapper around another registered method: ada-, critical-
            found.add(normalized(prefix + "kv"))
        else:
            found.add(normalized(name))
    return found


FENCED = re.compile(r"^```.*?^```", re.M | re.S)


def code_of(text: str) -> str:
    """The fenced blocks and backtick spans of a markdown text, one per line."""
    return "\n".join([*FENCED.findall(text), *BACKTICKED.findall(FENCED.sub("", text))])


def prose_of(text: str) -> str:
    """A markdown text without its fenced blocks and backtick spans."""
    return BACKTICKED.sub("", FENCED.sub("", text))


def setting_mentions(text: str) -> list[str]:
    return [next(group for group in match.groups() if group) for match in SETTING.finditer(code_of(text))]


def backticked_lists(text: str, known: set[str]) -> list[list[str]]:
    """Lists of three or more known names: inside one backtick span ("`a, b, c`") or as a run of spans
    joined by commas ("`a`, `b`, `c`")."""
    lists = []
    for span in BACKTICKED.findall(text):
        items = [item.strip() for item in span.split(",")]
        if len(items) >= 3 and sum(item in known for item in items) >= 3:
            lists.append(items)
    for run in re.finditer(r"`[^`\n]+`(?:,\s*(?:or\s+|and\s+)?`[^`\n]+`){2,}", text):
        items = BACKTICKED.findall(run.group(0))
        if sum(item in known for item in items) >= 3:
            lists.append(items)
    return lists


def prose_lists(text: str, family_names: set[str]) -> list[list[str]]:
    """Parenthesised prose lists with three or more method family names, items normalized."""
    flat = " ".join(prose_of(text).split())
    lists = []
    for group in re.findall(r"\(([^()]*)\)", flat):
        items = [normalized(item.removeprefix("and ")) for item in re.split(r",\s*|\s+and\s+", group)]
        if sum(item in family_names for item in items) >= 3:
            lists.append(items)
    return lists


def listed(item: str, listable: set[str]) -> bool:
    """A backticked list's item names something that exists: a name, or a pattern such as ``critical-*``
    that some registered name matches."""
    if item.endswith("-*"):
        return any(name.startswith(item[:-1]) for name in listable)
    return item in listable


def code_problems(text: str, names: list[str], decode_names: list[str]) -> list[str]:
    """What a doc names in code (settings, backticked lists) that the registry does not have (a backticked
    list may mix methods and packaged presets, as a list of presets does)."""
    registered = {*names, *decode_names, NO_METHOD}
    listable = registered | packaged_presets()
    problems = [
        f"setting names {name!r}"
        for name in setting_mentions(text)
        if name not in registered and name != BAD_EXAMPLE
    ]
    for items in backticked_lists(text, registered):
        problems += [f"list {items} names {item!r}" for item in items if not listed(item, listable)]
    return problems


def method_problems(text: str, names: list[str], decode_names: list[str]) -> list[str]:
    """What a doc names that the registry does not have: in code (``code_problems``) and in parenthesised
    prose lists of paper names."""
    problems = code_problems(text, names, decode_names)
    family_names = families(names)
    known = family_names | {normalized(name) for name in names}
    for items in prose_lists(text, family_names):
        problems += [f"list {items} names {item!r}" for item in items if item not in known]
    return problems


def incomplete_list(text: str, names: list[str]) -> list[str]:
    """The families the largest prose list of ``text`` leaves out ([] when it names no list)."""
    lists = prose_lists(text, families(names))
    largest = max(lists, key=lambda items: len(set(items) & families(names)), default=None)
    return [] if largest is None else sorted(families(names) - set(largest))


def test_the_families_come_from_the_registry():
    names = method_names()
    assert BAD_EXAMPLE not in names
    assert {"snapkv", "adakv", "criticalkv", "expectedattention"} <= families(names)
    assert "adasnapkv" not in families(names)  # a composition, not a family


@pytest.mark.parametrize("doc", CHECKED_DOCS, ids=lambda path: path.name)
def test_a_doc_names_only_registered_methods_and_no_partial_list(doc):
    if not doc.exists():
        pytest.skip(f"{doc.name} does not exist")
    assert method_problems(doc.read_text(), method_names(), decode_method_names()) == []


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda path: path.name)
def test_every_doc_names_only_registered_methods_in_code(doc):
    assert code_problems(doc.read_text(), method_names(), decode_method_names()) == []


def table_methods(text: str, heading: str, header: str) -> set[str]:
    """The backticked names in the first column of the table under ``heading`` whose header row starts with
    ``header`` ("`ada-snapkv` / `ada-pyramidkv`" names two)."""
    section = text[text.index(heading) :]
    table = section[section.index(header) :]
    rows = table[: table.index("\n\n")].splitlines()[2:]
    return {name for row in rows for name in BACKTICKED.findall(row.split("|")[1])}


def test_the_policies_table_names_every_registered_method():
    text = (ROOT / "docs" / "policies.md").read_text()
    assert table_methods(text, "# Eviction policies", "| method | paper |") == set(method_names())


def test_usage_lists_every_decode_method():
    row = re.search(r"^\| `--kv-decode-eviction METHOD` \| one of `([^`]+)`", USAGE.read_text(), re.M)
    assert row, "usage.md has no --kv-decode-eviction METHOD row"
    assert [name.strip() for name in row.group(1).split(",")] == decode_method_names()


def test_the_pyproject_description_names_no_partial_list_of_methods():
    description = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    assert method_problems(description, method_names(), decode_method_names()) == []
    assert incomplete_list(description, method_names()) == []


def test_a_method_list_in_the_readme_is_complete():
    assert incomplete_list(README.read_text(), method_names()) == []


def test_usage_lists_every_method_for_kv_eviction_and_in_its_table():
    text = USAGE.read_text()
    row = re.search(r"^\| `--kv-eviction METHOD` \| one of `([^`]+)`", text, re.M)
    assert row, "usage.md has no --kv-eviction METHOD row"
    assert [name.strip() for name in row.group(1).split(",")] == method_names()
    table = text[text.index("\n## Methods\n") :]
    table = table[: table.index("\n\n", table.index("| method |"))]
    in_table = {
        name for line in table.splitlines()[3:] for name in BACKTICKED.findall(line.split("|")[1])
    }
    assert in_table == set(method_names())


def test_a_planted_mismatch_fails():
    """The check itself: usage.md with one method removed from its list, and a README list one short."""
    names, decode_names = method_names(), decode_method_names()
    text = USAGE.read_text()
    planted = text.replace(", expected-attention, ada-", ", ada-", 1)
    assert planted != text
    row = re.search(r"^\| `--kv-eviction METHOD` \| one of `([^`]+)`", planted, re.M)
    assert [name.strip() for name in row.group(1).split(",")] != names
    short = "Per-head eviction (SnapKV, PyramidKV, Ada-KV, CriticalKV, NaCl, H2O, RoCo, StreamingLLM)."
    assert incomplete_list(short, names) == ["expectedattention", "keydiff", "knorm", "kvzap"]
    assert method_problems(short.replace("RoCo", "FooKV"), names, decode_names) != []
    assert method_problems("`--kv-eviction ada-h2o`", names, decode_names) == ["setting names 'ada-h2o'"]
    policies = (ROOT / "docs" / "policies.md").read_text()
    planted = re.sub(r"^\| `kvzap` \|.*\n", "", policies, count=1, flags=re.M)
    assert table_methods(planted, "# Eviction policies", "| method | paper |") == set(names) - {"kvzap"}
    assert code_problems("one of `snapkv, h2o, roco, fastkv`", names, decode_names) != []
    assert code_problems("`critical-*`, `snapkv`, `h2o`", names, decode_names) == []


FLAGS_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys, tomllib
    project = tomllib.load(open(sys.argv[1], "rb"))["project"]
    entry = project["entry-points"]["vllm.general_plugins"]["kvevict"]
    module, _, function = entry.partition(":")
    getattr(importlib.import_module(module), function)()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser())
    groups = {g.title: [o for a in g._group_actions for o in a.option_strings] for g in parser._action_groups}
    choices = {o: list(a.choices) for a in parser._actions if a.choices for o in a.option_strings}
    print(json.dumps({"group": groups.get("KVEviction"), "all": sorted(parser._option_string_actions),
                      "choices": choices}))
    """
)


@pytest.fixture(scope="module")
def serve_flags() -> dict:
    """The flags of ``vllm serve`` with the plugin loaded through its entry point (pyproject.toml), in a
    fresh interpreter (the plugin patches vLLM for the process): {"group": the KVEviction group's flags,
    "all": every option, "choices": {flag: its choices} for each flag that has them}."""
    env = {**os.environ, "VLLM_PLUGINS": "none-of-them", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", FLAGS_SCRIPT, str(ROOT / "pyproject.toml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_usage_documents_every_eviction_flag_and_no_other(serve_flags):
    text = USAGE.read_text()
    group = serve_flags["group"]
    assert group, "vllm serve has no KVEviction group: `--help=KVEviction` would show nothing"
    assert [flag for flag in group if f"`{flag}" not in text] == []
    named = set(re.findall(r"(--kv-[a-z][a-z-]*[a-z])(?![\w*-])", text))  # not "--kv-decode-*"
    assert sorted(named - set(serve_flags["all"])) == []
    count = re.search(r"--help=KVEviction` shows the (\w+) flags", text)
    assert count and NUMBER_WORDS[count.group(1)] == len(group)


def packaged_presets() -> set[str]:
    return {path.stem for path in PRESETS.glob("*.yaml")}


def preset_mentions(text: str) -> set[str]:
    """Presets a doc names: ``--kv-eviction-config NAME`` (a bare word) and ``configs/NAME.yaml`` paths."""
    bare = re.findall(r"--kv-eviction-config[ =]([a-z0-9][a-z0-9-]*)(?![\w./-]|\s+--)", text)
    paths = re.findall(r"(?:configs|presets)/([a-z0-9-]+)\.ya?ml", text)
    return {*bare, *paths} - {"nope"}  # the docs' example of a missing preset


def test_usage_names_every_packaged_preset():
    text = USAGE.read_text()
    section = text[text.index("\n### Presets\n") :]
    section = section[: section.index("\n### ", 5)]
    assert sorted(name for name in packaged_presets() if f"`{name}`" not in section) == []


#: argparse's refusal of a value outside a flag's choices, as a doc quotes it; "..." ends an abridged list
INVALID_CHOICE = re.compile(r"argument (--[a-z-]+): invalid choice: '[^']*' \(choose from ([^)\n]*)\)")


def choice_problems(text: str, choices: dict[str, list[str]]) -> list[str]:
    """Each quoted "invalid choice" line whose list is not the parser's choices for that flag (an abridged
    list, ending in ``...``, must be their beginning)."""
    problems = []
    for flag, quoted in INVALID_CHOICE.findall(text):
        items = [item.strip() for item in quoted.split(",")]
        abridged = items[-1] == "..."
        names = [item.strip("'") for item in items[:-1] if abridged] or [item.strip("'") for item in items]
        real = choices.get(flag, [])
        if (real[: len(names)] if abridged else real) != names:
            problems.append(f"{flag}: quoted {names}, the parser has {real}")
    return problems


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda path: path.name)
def test_a_quoted_invalid_choice_line_lists_the_parsers_choices(doc, serve_flags):
    assert choice_problems(doc.read_text(), serve_flags["choices"]) == []


def test_troubleshooting_quotes_every_choice_flag_of_the_plugin(serve_flags):
    quoted = {flag for flag, _ in INVALID_CHOICE.findall((ROOT / "docs" / "troubleshooting.md").read_text())}
    assert sorted(set(serve_flags["group"]) & set(serve_flags["choices"]) - quoted) == []


def test_a_planted_choice_mismatch_fails(serve_flags):
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    planted = text.replace(", 'kvzap', 'ada-kvzap')", ")", 1)
    assert planted != text
    assert [problem.split(":")[0] for problem in choice_problems(planted, serve_flags["choices"])] == [
        "--kv-eviction"
    ]


#: the preset list of the "no preset named" refusal (``policies/presets.py``) as troubleshooting.md quotes it
PRESET_LIST = re.compile(r"no preset named '[^']*'; presets: ([a-z0-9, -]+) \(")


def test_troubleshooting_quotes_the_packaged_presets():
    found = PRESET_LIST.findall((ROOT / "docs" / "troubleshooting.md").read_text())
    assert found, "troubleshooting.md quotes no preset list"
    assert [sorted(item.strip() for item in names.split(",")) for names in found] == [
        sorted(packaged_presets())
    ] * len(found)


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda path: path.name)
def test_the_presets_any_doc_names_ship_with_the_package(doc):
    assert sorted(preset_mentions(doc.read_text()) - packaged_presets()) == []
