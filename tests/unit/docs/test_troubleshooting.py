"""docs/troubleshooting.md against the code: every refusal message the package can produce is quoted there,
and every line the page quotes is one the code still produces.

The messages are found by scanning the package's source (``ast``), not by importing modules by path, so
they are found wherever a message moves. A message is the first argument of:

- ``raise EvictionConfigError(...)``, ``raise UnsupportedEngineSetting(...)``, ``raise
  ModelRefusedError(...)`` or ``raise ...ArgumentTypeError(...)``, anywhere in the package but ``cli/`` (the
  ``vllm-kvevict`` tool's own arguments): a bad setting, a ``vllm serve: error:`` line at start-up or an
  HTTP 400 per request;
- a call of ``_refusal(...)`` (a model or setting eviction cannot serve), and the f-string returned by a
  function whose name ends in ``_refusal`` (the refusal line itself, the vLLM version line);
- ``raise ValueError/RuntimeError/LookupError(...)`` in ``vllm_adapter/`` (the engine's own refusals), in
  the registry and presets of ``policies/`` (``registry.py``, ``presets.py``: the method and preset names
  every start-up checks) and in the ``check_*`` functions of ``policies/`` (the parameter checks).

Only string literals, f-strings and their concatenations count; each ``{...}`` becomes "some text". The
page's quotes are the lines of its fenced code blocks, each written as the user sees it, with example values
(``vllm serve: error: `` and argparse's ``argument --flag: `` in front where the CLI adds them). A quote is
explained by a message it matches whole that has at least ``MIN_CONSTANT`` characters of its own, or by
argparse's own "invalid choice" line for a flag with choices. A message that ends by formatting a caught
exception (``f"kv_eviction.params for {method!r}: {exc}"``) wraps another: it explains a quote only when the
rest of the quote is explained too (whole, or without the inner message's leading ``{...}: ``, which the
code may strip).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "vllm_kvevict"
PAGE = ROOT / "docs" / "troubleshooting.md"
SETTING_ERRORS = {
    "EvictionConfigError",
    "ModelRefusedError",
    "UnsupportedEngineSetting",
    "ArgumentTypeError",
}
ENGINE_ERRORS = {"ValueError", "RuntimeError", "LookupError"}
#: what the CLI puts in front of a message (``cli_args.CLI_ERROR_PREFIX``; argparse names the flag)
CLI_PREFIX = re.compile(r"^vllm serve: error: (?:argument --[a-z-]+: )?")
ARGPARSE_CHOICE = re.compile(r"invalid choice: '[^']*' \(choose from '[^']+'(?:, '[^']+')*\)")
MIN_CONSTANT = 10
PLACEHOLDER = "\0"


@dataclass(frozen=True)
class Message:
    """A message template: its text with each ``{...}`` as PLACEHOLDER, and where it is raised."""

    text: str
    where: str
    wraps: bool = False  # its last placeholder is a caught exception: another message follows

    @property
    def pattern(self) -> re.Pattern[str]:
        parts = [re.escape(re.sub(r"\s+", " ", part)) for part in self.text.split(PLACEHOLDER)]
        return re.compile(r".*?".join(parts))

    @property
    def unprefixed(self) -> Message:
        """The message without its leading "{...}: " (the code strips it where it wraps one)."""
        return Message(self.text.removeprefix(PLACEHOLDER + ": "), self.where)

    @property
    def constant_length(self) -> int:
        return len(self.text.replace(PLACEHOLDER, ""))


def template(node: ast.expr) -> str | None:
    """The text of a string literal, f-string or concatenation of them (``{...}`` as PLACEHOLDER)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else PLACEHOLDER for part in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = template(node.left), template(node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else PLACEHOLDER) + (right if right is not None else PLACEHOLDER)
    return None


def called_name(node: ast.expr) -> str:
    func = node.func if isinstance(node, ast.Call) else node
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def engine_raise(path: Path, function: str) -> bool:
    """``vllm_adapter/``; the registry, presets and ``check_*`` functions of ``policies/``."""
    parts = path.relative_to(PACKAGE).parts
    if parts[0] == "vllm_adapter":
        return True
    return parts[0] == "policies" and (
        path.name in ("registry.py", "presets.py") or function.startswith("check_")
    )


def tool_module(path: Path) -> bool:
    return path.relative_to(PACKAGE).parts[0] == "cli"


def wraps_exception(expr: ast.expr, function: ast.AST | None) -> bool:
    """True for an f-string whose last part formats a name bound by ``except ... as NAME`` in ``function``."""
    if function is None or not isinstance(expr, ast.JoinedStr) or not expr.values:
        return False
    last = expr.values[-1]
    if not isinstance(last, ast.FormattedValue):
        return False
    caught = {node.name for node in ast.walk(function) if isinstance(node, ast.ExceptHandler) and node.name}
    return any(isinstance(node, ast.Name) and node.id in caught for node in ast.walk(last.value))


def messages_in(path: Path) -> list[Message]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[ast.expr, int, ast.AST | None]] = []

    def visit(node: ast.AST, function: ast.FunctionDef | None) -> None:
        name = function.name if function is not None else ""
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            error = called_name(node.exc)
            if (error in SETTING_ERRORS and not tool_module(path)) or (
                error in ENGINE_ERRORS and engine_raise(path, name)
            ):
                found.append((node.exc.args[0], node.lineno, function))
        elif isinstance(node, ast.Call) and called_name(node) == "_refusal":
            found.extend((arg, node.lineno, function) for arg in node.args)
        elif isinstance(node, ast.Return) and node.value is not None and name.endswith("_refusal"):
            found.append((node.value, node.lineno, function))
        inner = node if isinstance(node, ast.FunctionDef) else function
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, None)
    where = path.relative_to(ROOT)
    messages = []
    for expr, line, function in found:
        text = template(expr)
        if text and text != PLACEHOLDER:
            messages.append(Message(text, f"{where}:{line}", wraps_exception(expr, function)))
    return messages


def package_messages() -> list[Message]:
    return [message for path in sorted(PACKAGE.rglob("*.py")) for message in messages_in(path)]


def quoted_lines(page: str) -> list[str]:
    """The lines of the page's fenced code blocks, the CLI's prefix removed, whitespace normalized."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", page, re.M | re.S)
    lines = [line for block in blocks for line in block.splitlines() if line.strip()]
    return [CLI_PREFIX.sub("", " ".join(line.split())) for line in lines]


def test_the_scan_finds_each_kind_of_message():
    texts = [message.text for message in package_messages()]
    assert any(text.startswith("kv eviction refused: ") for text in texts)  # the refusal line
    assert any("is not a known method; valid: " in text for text in texts)  # a 400 of vllm_xargs
    assert any("is not supported with --kv-eviction" in text for text in texts)  # a guard rail
    assert any(text.startswith("vllm-kvevict: vLLM ") for text in texts)  # the version line
    assert any("no preset named" in text for text in texts)  # a preset name


def explained(quote: str, messages: list[Message]) -> bool:
    """Whether ``quote`` is a line the code produces (see the module docstring)."""
    if ARGPARSE_CHOICE.fullmatch(quote):
        return True
    for message in messages:
        if message.wraps:
            prefix = Message(message.text.removesuffix(PLACEHOLDER), message.where).pattern
            found = re.match(prefix.pattern + "(.+)$", quote)
            if found and (
                explained(found.group(found.lastindex), messages)
                or stripped(found.group(found.lastindex), messages)
            ):
                return True
        elif message.constant_length >= MIN_CONSTANT and message.pattern.fullmatch(quote):
            return True
    return False


def stripped(rest: str, messages: list[Message]) -> bool:
    """``rest`` is a message whose leading "{...}: " the code removed (``str(exc).removeprefix(...)``)."""
    return any(
        message.unprefixed.pattern.fullmatch(rest)
        for message in messages
        if message.text.startswith(PLACEHOLDER + ": ") and not message.wraps
    )


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text()


def test_every_message_of_the_code_is_quoted_on_the_page(page):
    lines = quoted_lines(page)
    missing = [
        f"{message.where}: {message.text.replace(PLACEHOLDER, '{…}')}"
        for message in package_messages()
        if not any(message.unprefixed.pattern.search(line) for line in lines)
    ]
    assert missing == []


def test_the_page_quotes_only_messages_the_code_produces(page):
    messages = package_messages()
    stale = [line for line in quoted_lines(page) if not explained(line, messages)]
    assert stale == []


def test_a_changed_message_is_caught():
    """The check itself: a quote whose wording the code no longer has matches no message."""
    messages = package_messages()
    for quote in (
        "kv_eviction.prefill='fast' is not valid; valid: chunked, whole",
        "kv_eviction.params for 'snapkv': SnapKV: window=0 is not valid; it must be an int >= 1",
        "kv_eviction.between='x' is not valid; choose one of window, blend",
    ):
        assert explained(quote, messages)
        assert not explained(quote.replace("is not valid", "is invalid"), messages)
