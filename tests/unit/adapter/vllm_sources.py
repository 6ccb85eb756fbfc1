"""What the installed vLLM defines, read from its source files (never from the classes at run time: the
plugin's wrappers replace methods in the test process), and what the plugin's own modules take from vLLM.

Each ``*_problem`` function returns why an entry of ``vllm_adapter/vllm_boundary/`` no longer holds, or
None.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pathlib
from collections.abc import Iterator

from vllm_kvevict.vllm_adapter.vllm_boundary import VllmPart

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "vllm_kvevict"


def resolve(dotted: str) -> type:
    """The class at ``dotted`` (``module.Class``)."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@functools.cache
def parsed(path: str) -> ast.Module:
    return ast.parse(pathlib.Path(path).read_text())


def class_node(cls: type) -> ast.ClassDef | None:
    """The ``class`` statement of ``cls`` in its module's source, or None (a builtin, no source)."""
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return None
    if path is None:
        return None
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    return None


def vllm_mro(cls: type) -> list[type]:
    return [base for base in cls.__mro__ if base.__module__.split(".")[0] == "vllm"]


def function_node(cls: type, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The first definition of method ``name`` along ``cls``'s vLLM bases, as their source defines it."""
    for base in vllm_mro(cls):
        node = class_node(base)
        for statement in node.body if node else ():
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == name:
                return statement
    return None


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """Parameter names after self/cls (a staticmethod keeps its first)."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    return tuple(names if static else names[1:])


def method_problem(entry: VllmPart) -> str | None:
    try:
        cls = resolve(entry.owner)
    except (ImportError, AttributeError) as exc:
        return f"{entry.owner}: {exc}"
    node = function_node(cls, entry.names)
    if node is None:
        return f"{entry.owner}.{entry.names}: no such method"
    found = parameters(node)
    if found != entry.parameters:
        return f"{entry.owner}.{entry.names}: parameters {found}, listed {entry.parameters}"
    return None


def import_problem(entry: VllmPart) -> str | None:
    try:
        module = importlib.import_module(entry.owner)
    except ImportError as exc:
        return f"{entry.owner}: {exc}"
    for name in entry.listed:
        if hasattr(module, name):
            continue
        try:
            importlib.import_module(f"{entry.owner}.{name}")
        except ImportError:
            return f"{entry.owner}.{name}: not found"
    return None


#: calls that give a module an attribute named by their first argument
_NAMING_CALLS = frozenset({"register_buffer", "register_parameter", "setattr"})


def assigned_names(tree: ast.AST) -> set[str]:
    """Attribute names assigned anywhere in ``tree`` (``x.name = ...``, ``x.name: T = ...``, ``+=``,
    ``register_buffer("name", ...)``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _callee(node) in _NAMING_CALLS:
            named = node.args[1:2] if _callee(node) == "setattr" else node.args[:1]
            found.update(a.value for a in named if isinstance(a, ast.Constant) and isinstance(a.value, str))
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute):
                    found.add(part.attr)
    return found


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def class_level_names(node: ast.ClassDef) -> set[str]:
    """Names a class statement defines: fields, annotations, methods, properties."""
    found = set()
    for statement in node.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(statement.name)
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            found.add(statement.target.id)
        elif isinstance(statement, ast.Assign):
            found.update(t.id for t in statement.targets if isinstance(t, ast.Name))
    return found


def attributes_problem(entry: VllmPart) -> str | None:
    try:
        cls = resolve(entry.owner)
    except (ImportError, AttributeError) as exc:
        return f"{entry.owner}: {exc}"
    defined: set[str] = set()
    for base in vllm_mro(cls):
        node = class_node(base)
        if node is not None:
            defined |= class_level_names(node) | assigned_names(parsed(inspect.getsourcefile(base)))
    if entry.set_in:
        defined |= assigned_names(parsed(inspect.getsourcefile(importlib.import_module(entry.set_in))))
    missing = [name for name in entry.listed if name not in defined and not hasattr(cls, name)]
    return f"{entry.owner}: no {', '.join(missing)}" if missing else None


def vllm_imports(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """(line, module, name) of every import of vLLM in ``tree`` (name "" for ``import vllm.x``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module or ""):
            for alias in node.names:
                yield node.lineno, node.module or "", alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_vllm(alias.name):
                    yield node.lineno, alias.name, ""


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def unlisted_imports(tree: ast.AST, listed: tuple[VllmPart, ...]) -> list[str]:
    """``module.name`` of each vLLM import in ``tree`` that no entry of ``listed`` names."""
    names = {(entry.owner, name) for entry in listed for name in entry.listed}
    modules = {entry.owner for entry in listed}
    return [
        f"line {line}: {module}{'.' + name if name else ''}"
        for line, module, name in vllm_imports(tree)
        if (module, name) not in names and not (not name and module in modules)
    ]


def wrapped_in(tree: ast.AST) -> set[tuple[str, str]]:
    """(class, method) of every ``_wrap(Class, "method", ...)`` call and ``Class.method = ...`` assignment
    of a vLLM class in ``tree`` (``vllm_patches.py``)."""
    imported = {name for _, _, name in vllm_imports(tree)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_wrap" and len(node.args) >= 2:
            owner, name = node.args[0], node.args[1]
            if isinstance(owner, ast.Name) and isinstance(name, ast.Constant):
                found.add((owner.id, str(name.value)))
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and getattr(target.value, "id", "") in imported:
                    found.add((target.value.id, target.attr))  # type: ignore[attr-defined]
    return found


def overridden_by(module_name: str) -> set[tuple[type, str]]:
    """(vLLM class, method) for each method a class of ``module_name`` (or a mixin it puts before a vLLM
    class) defines over a method of a vLLM base; dataclass-made methods aside."""
    module = importlib.import_module(module_name)
    found = set()
    for cls in vars(module).values():
        if not isinstance(cls, type) or cls.__module__ != module_name or not vllm_mro(cls):
            continue
        first_vllm = vllm_mro(cls)[0]
        own = cls.__mro__[: cls.__mro__.index(first_vllm)]
        for part in own:
            made = (
                {"__init__", "__repr__", "__eq__", "__hash__"}
                if "__dataclass_fields__" in vars(part)
                else set()
            )
            for name, value in vars(part).items():
                callable_ = inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod))
                dunder = name.startswith("__") and name != "__init__"
                if callable_ and not dunder and name not in made and hasattr(first_vllm, name):
                    found.add((first_vllm, name))
    return found


def plugin_modules() -> Iterator[tuple[str, pathlib.Path]]:
    """(module name, path) of every module of the package."""
    root = PACKAGE.parent
    for path in sorted(PACKAGE.rglob("*.py")):
        yield ".".join(path.relative_to(root).with_suffix("").parts), path


def imports_vllm(path: pathlib.Path) -> bool:
    return any(True for _ in vllm_imports(parsed(str(path))))
