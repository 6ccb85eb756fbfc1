"""The calibration corpus: the docstrings of the Python standard library, read from its source files.

Every Python installation ships them (``sysconfig``'s ``stdlib`` directory), so the command needs no
download. They are varied technical English written by many authors over decades: explanatory prose, lists of
parameters, numbers, names, quoted code and examples - the mix of prose, identifiers and figures that served
prompts (documents, RAG passages, chats about code) hold. KVzip's targets measure which entries a model needs
to reproduce its context, a property of the model's attention rather than of the topic, so a scorer fitted on
this text is expected to carry over to other text; the held-out fit printed by ``calibrate`` is measured on
contexts the fit did not see.

The evaluation tasks are kept out: the files are parsed (``ast``), never imported, and a docstring holding any
string literal of ``vllm_kvevict/evaluation`` (needle sentences, RULER templates, haystack sentences, question
wordings; the constant parts of f-strings and templates) of ``MIN_LITERAL`` characters and
``MIN_LITERAL_WORDS`` words or more is dropped, as is one naming a needle or a haystack.
A context is a seeded draw of whole docstrings, joined by blank lines, cut to a seeded length.
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
from collections.abc import Callable
from pathlib import Path

EVALUATION_PACKAGE = Path(__file__).resolve().parent.parent / "evaluation"
#: evaluation literals of this many characters and words or more may not occur in the corpus (shorter ones
#: are common words; "Here we go.", a haystack sentence, is just long enough)
MIN_LITERAL = 10
MIN_LITERAL_WORDS = 3
#: words that mark needle-in-a-haystack text
BANNED_WORDS = ("needle", "haystack", "magic number", "special magic")
#: docstrings shorter than this are mostly one-line summaries; they are skipped
MIN_DOCSTRING = 200
#: stdlib folders that are tests or third-party vendored code rather than the library's own documentation
SKIPPED_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def evaluation_literals(package: Path = EVALUATION_PACKAGE) -> set[str]:
    """String constants (and the constant parts of f-strings and ``{}`` templates) of at least ``MIN_LITERAL``
    characters and ``MIN_LITERAL_WORDS`` words in the evaluation package's source (``ast``, no import)."""
    found: set[str] = set()
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for part in node.value.split("{"):
                    text = part.split("}")[-1].strip()
                    if len(text) >= MIN_LITERAL and len(text.split()) >= MIN_LITERAL_WORDS:
                        found.add(text)
    return found


def is_evaluation_text(text: str, literals: set[str]) -> bool:
    """True when ``text`` holds an evaluation literal or a needle-in-a-haystack word."""
    lowered = text.lower()
    return any(word in lowered for word in BANNED_WORDS) or any(literal in text for literal in literals)


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's own ``.py`` files under ``root`` (default: this interpreter's), sorted."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    return [
        path
        for path in sorted(base.rglob("*.py"))
        if not SKIPPED_PARTS.intersection(path.relative_to(base).parts)
    ]


def file_docstrings(path: Path) -> list[str]:
    """The module, class and function docstrings of one source file, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
    return [doc for doc in docs if doc and len(doc) >= MIN_DOCSTRING]


def corpus_documents(root: Path | None = None, literals: set[str] | None = None) -> list[str]:
    """Every usable stdlib docstring, evaluation text dropped; in file order (deterministic)."""
    banned = evaluation_literals() if literals is None else literals
    return [
        doc
        for path in stdlib_files(root)
        for doc in file_docstrings(path)
        if not is_evaluation_text(doc, banned)
    ]


@functools.cache
def default_documents() -> tuple[str, ...]:
    """``corpus_documents()`` of this interpreter's standard library, parsed once per process."""
    return tuple(corpus_documents())


def calibration_contexts(
    encode: Callable[[str], list[int]],
    num_contexts: int,
    min_tokens: int,
    max_tokens: int,
    seed: int = 0,
    documents: list[str] | tuple[str, ...] | None = None,
) -> list[list[int]]:
    """``num_contexts`` token id lists of seeded lengths in [min_tokens, max_tokens]: each a seeded run of
    whole docstrings (``encode``: text -> ids, no special tokens) cut to its length."""
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(
            f"context lengths must satisfy 0 < min_tokens <= max_tokens; got {min_tokens}, {max_tokens}"
        )
    docs = default_documents() if documents is None else documents
    if not docs:
        raise ValueError("the calibration corpus is empty: no standard-library docstrings were found")
    rng = random.Random(seed)
    contexts = []
    for _ in range(num_contexts):
        length = rng.randint(min_tokens, max_tokens)
        ids: list[int] = []
        while len(ids) < length:
            ids += encode(docs[rng.randrange(len(docs))] + "\n\n")
        contexts.append(ids[:length])
    return contexts
