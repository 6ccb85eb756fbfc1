"""Build the GPU bundle: a folder a GPU host without vLLM or network unpacks and serves from.

    .venv/bin/python -m benchmarks.gpu.build_bundle [--out benchmarks/gpu/bundle] [--cache DIR]

The folder (gitignored; the device tool carries it, see docs/deploy.md):

- ``vllm-tree.tar.xz``: vLLM 0.32.0's Python tree from the official wheel, patched (``vllm_tree``);
- ``wheels/``: the pinned cp312 wheels of ``wheels.txt``, what the GPU host lacks (already compressed);
- ``model.tar.xz``: the bundled model's config and tokenizer (``vllm-kvevict prepare-model``), no
  weights: the servers load ``--load-format dummy``;
- ``kvevict.tar.xz``: ``vllm_kvevict-<version>.dist-info``, the project's metadata and entry points (the
  ``vllm.general_plugins`` one activates the plugin); the code itself is the working tree the device tool
  copies, on ``PYTHONPATH``, so the bundle never runs stale project code;
- ``manifest.json``: what went in, each part's size, the vLLM wheel's sha256.

The folder must stay under 64 MiB (the device tool's limit for everything it copies, working tree
included): the build fails otherwise, naming the size of every part.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

from benchmarks.gpu import downloads, vllm_tree

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "benchmarks" / "gpu" / "bundle"
MIB = 2**20
#: The device tool copies at most 64 MiB per job, working tree and carried paths together.
SIZE_LIMIT = 64 * MIB
#: Weight files stay behind (SmolLM2-135M's safetensors is 257 MiB).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
XZ_PRESET = 6


class BundleTooLarge(RuntimeError):
    """The archive exceeds :data:`SIZE_LIMIT`."""


def prepared_model_dir() -> Path:
    """The converted bundled model (``vllm-kvevict prepare-model --quiet`` prints its directory)."""
    tool = Path(sys.executable).parent / "vllm-kvevict"
    result = subprocess.run([str(tool), "prepare-model", "--quiet"], check=True, capture_output=True,
                            text=True)
    return Path(result.stdout.strip().splitlines()[-1])


def copy_model_without_weights(model_dir: Path, dest: Path) -> list[str]:
    """Config, generation config and tokenizer files of ``model_dir`` into ``dest``; names copied."""
    dest.mkdir(parents=True)
    copied = []
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copyfile(path, dest / path.name)
            copied.append(path.name)
    if "config.json" not in copied:
        raise FileNotFoundError(f"{model_dir} has no config.json")
    return copied


def write_project_dist_info(dest: Path) -> Path:
    """``vllm_kvevict-<version>.dist-info`` (METADATA, entry_points.txt) from ``pyproject.toml``."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    info = dest / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    sections = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    lines = []
    for group, entries in sections.items():
        lines.append(f"[{group}]")
        lines.extend(f"{key} = {value}" for key, value in entries.items())
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return info


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pack(directory: Path, archive: Path, preset: int) -> int:
    """``directory``'s contents as ``archive`` (tar, xz at ``preset``); returns the archive's size."""
    with tarfile.open(archive, "w:xz", preset=preset) as tar:
        for path in sorted(directory.iterdir()):
            tar.add(path, arcname=path.name)
    return archive.stat().st_size


def bundle_size(out: Path) -> int:
    """Bytes of every file of the bundle directory ``out``: what the device tool carries."""
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def build(out: Path = DEFAULT_OUT, cache: Path | None = None, model_dir: Path | None = None,
          size_limit: int = SIZE_LIMIT, preset: int = XZ_PRESET) -> dict:
    """Build the bundle directory ``out`` (its parts and ``manifest.json``); return the manifest. Raises
    :class:`BundleTooLarge` (after writing it) when the bundle exceeds ``size_limit``."""
    started = time.monotonic()
    if out.exists():
        shutil.rmtree(out)
    staging = out / "staging"
    staging.mkdir(parents=True)
    wheel = downloads.vllm_wheel(cache)
    tree = vllm_tree.extract_tree(wheel, staging / "vllm-tree")
    pinned = downloads.pinned_wheels(cache)
    (out / "wheels").mkdir()
    for path in pinned:
        shutil.copyfile(path, out / "wheels" / path.name)
    model_files = copy_model_without_weights(model_dir or prepared_model_dir(), staging / "model")
    dist_info = write_project_dist_info(staging / "kvevict")
    sizes = {f"{name}.tar.xz": pack(staging / name, out / f"{name}.tar.xz", preset)
             for name in ("vllm-tree", "model", "kvevict")}
    sizes["wheels/"] = sum(p.stat().st_size for p in (out / "wheels").iterdir())
    shutil.rmtree(staging)
    manifest = {
        "vllm_wheel": wheel.name,
        "vllm_wheel_sha256": sha256(wheel),
        "vllm_wheel_bytes": wheel.stat().st_size,
        "tree_files": tree.kept_files,
        "tree_plain_bytes": tree.kept_bytes,
        "tree_dropped_files": tree.dropped_files,
        "tree_dropped_bytes": tree.dropped_bytes,
        "tree_dropped_largest": tree.dropped_largest,
        "patches": tree.patches,
        "wheels": [p.name for p in pinned],
        "model_files": model_files,
        "project_dist_info": dist_info.name,
        "part_bytes": sizes,
        "xz_preset": preset,
        "python_built_with": sys.version.split()[0],
        "size_limit_bytes": size_limit,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    manifest["bundle_bytes"] = bundle_size(out)
    manifest["build_seconds"] = round(time.monotonic() - started, 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if manifest["bundle_bytes"] > size_limit:
        raise BundleTooLarge(
            f"{out} is {manifest['bundle_bytes'] / MIB:.1f} MiB, over the {size_limit / MIB:.0f} MiB limit; "
            f"parts (MiB): { {k: round(v / MIB, 1) for k, v in sizes.items()} }"
        )
    return manifest


def summary(manifest: dict) -> str:
    parts = ", ".join(f"{name} {size / MIB:.1f}" for name, size in manifest["part_bytes"].items())
    return (
        f"bundle: {manifest['bundle_bytes'] / MIB:.1f} MiB (limit "
        f"{manifest['size_limit_bytes'] / MIB:.0f}); parts, MiB: {parts}; from {manifest['vllm_wheel']} "
        f"({manifest['vllm_wheel_bytes'] / MIB:.0f} MiB, {manifest['tree_files']} files kept); "
        f"{len(manifest['wheels'])} wheels; built in {manifest['build_seconds']} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--cache", type=Path, default=None, help="download cache (default: %(default)s → "
                        f"{downloads.cache_dir()})")
    parser.add_argument("--xz-preset", type=int, default=XZ_PRESET, help="xz level (default %(default)s)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="model directory (default: `vllm-kvevict prepare-model --quiet`)")
    args = parser.parse_args(argv)
    try:
        manifest = build(args.out, args.cache, args.model_dir, preset=args.xz_preset)
    except BundleTooLarge as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(summary(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
