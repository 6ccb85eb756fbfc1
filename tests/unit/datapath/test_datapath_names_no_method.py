"""``datapath/`` never names an eviction method: it imports nothing from a method's own module (a capability
is asked of the policy: ``pools_layers``, ``kept_score_floor``, ``reads_query_statistics`` ...) and holds no
registered method name as a string outside its docstrings."""

from __future__ import annotations

import ast
import pathlib

from vllm_kvevict.policies.decode.decode_scored import DecodeForm
from vllm_kvevict.policies.registry import _METHODS, decode_method_names, decode_methods, method_names

DATAPATH = pathlib.Path(__file__).resolve().parents[3] / "vllm_kvevict" / "datapath"


def method_modules() -> set[str]:
    """The modules that define a registered prefill or decode method's classes."""
    parts = [part for method in _METHODS.values() for part in method.parts]
    for builder, _ in decode_methods().values():
        parts.append(builder.inner if isinstance(builder, DecodeForm) else builder)
    return {part.__module__ for part in parts}


def imported_modules(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of the module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                found.add(id(body[0].value))
    return found


def method_literals(tree: ast.AST, names: set[str]) -> list[str]:
    skipped = docstrings(tree)
    return [
        f"line {node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in skipped
    ]


def datapath_trees() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text()) for path in sorted(DATAPATH.glob("*.py"))}


def test_the_method_modules_are_found() -> None:
    assert {"vllm_kvevict.policies.kvzap", "vllm_kvevict.policies.snapkv"} <= method_modules()
    assert "vllm_kvevict.policies.base" not in method_modules()


def test_datapath_imports_no_method_module() -> None:
    methods = method_modules()
    found = {name: sorted(imported_modules(tree) & methods) for name, tree in datapath_trees().items()}
    assert {name: modules for name, modules in found.items() if modules} == {}


def test_datapath_holds_no_method_name_literal() -> None:
    names = set(method_names()) | set(decode_method_names())
    found = {name: method_literals(tree, names) for name, tree in datapath_trees().items()}
    assert {name: literals for name, literals in found.items() if literals} == {}


def test_a_planted_method_import_and_name_are_seen() -> None:
    tree = ast.parse(
        '"""kvzap in a docstring is fine."""\nfrom vllm_kvevict.policies.kvzap import KVzap\nX = "kvzap"\n'
    )
    assert imported_modules(tree) & method_modules() == {"vllm_kvevict.policies.kvzap"}
    assert method_literals(tree, {"kvzap"}) == ["line 3: 'kvzap'"]
