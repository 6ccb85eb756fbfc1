"""Unpack the GPU bundle into a work folder, the wheels into a site folder; print the ``PYTHONPATH`` to use.

    python3 benchmarks/gpu/unpack.py BUNDLE_DIR WORK_DIR [--foreign-python]

Standard library only: it runs on the GPU host before anything from the bundle is importable. The wheels go
in with ``pip install --no-deps --no-index --target WORK/site`` (no venv: the host's torch, triton and
transformers stay in use). ``--foreign-python`` is for a dry run on another interpreter (the development
machine's 3.11): pip is told the GPU host's Python 3.12 and manylinux tags, so it unpacks the cp312 wheels
without installing anything it could not import, and the printed path leaves them out.

Also writes ``WORK/missing_requirements.json``: vLLM's own requirements (its METADATA, no extras) that no
distribution on the resulting path provides. On the GPU host that list should be empty or name only
packages of paths the job does not take.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

PARTS = ("vllm-tree", "model", "kvevict")
GPU_HOST_TAGS = (
    "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
    "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_31_x86_64",
)


def unpack(bundle: Path, work: Path, foreign_python: bool = False) -> dict[str, Path]:
    """Extract the bundle's parts under ``work`` and install its wheels into ``work/site``; return the
    folders by role (vllm-tree, model, kvevict, site)."""
    folders = {}
    for part in PARTS:
        dest = work / part
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(bundle / f"{part}.tar.xz") as tar:
            tar.extractall(dest, filter="data")
        folders[part] = dest
    site = work / "site"
    wheels = sorted(str(p) for p in (bundle / "wheels").glob("*.whl"))
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-compile",
               "--upgrade", "--target", str(site), *(GPU_HOST_TAGS if foreign_python else ()), *wheels]
    subprocess.run(command, check=True)
    folders["site"] = site
    return folders


def python_path(folders: dict[str, Path], repo: Path, foreign_python: bool = False) -> str:
    """vLLM's tree first (it shadows any other vLLM), the wheels, the project's metadata, its code. With
    ``foreign_python`` the wheels stay off the path: their cp312 extensions do not load here, and this
    interpreter's environment has the same packages."""
    order = (folders["vllm-tree"], *(() if foreign_python else (folders["site"],)), folders["kvevict"], repo)
    return ":".join(str(p) for p in order)


def requirement_names(metadata: str) -> list[str]:
    """Distribution names of the unconditional and marker-only ``Requires-Dist`` lines (no extras)."""
    names = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1]
        if "extra ==" in requirement:
            continue
        if ";" in requirement and not _marker_holds(requirement.split(";", 1)[1]):
            continue
        names.append(re.split(r"[\s<>=!~\[;(]", requirement.strip(), maxsplit=1)[0])
    return names


def _marker_holds(marker: str) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:  # without packaging, count the requirement: a false alarm, not a miss
        return True
    return Marker(marker).evaluate({"python_version": "3.12", "platform_machine": "x86_64",
                                    "sys_platform": "linux", "platform_system": "Linux"})


def missing_requirements(folders: dict[str, Path], repo: Path, foreign_python: bool = False) -> list[str]:
    """vLLM's requirements no distribution on the bundle's path (plus this interpreter's) provides."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "names = json.loads(sys.argv[1]); missing = []\n"
        "for n in names:\n"
        "    try: m.version(n)\n"
        "    except m.PackageNotFoundError: missing.append(n)\n"
        "print(json.dumps(missing))\n"
    )
    metadata = next(folders["vllm-tree"].glob("vllm-*.dist-info")) / "METADATA"
    names = requirement_names(metadata.read_text())
    env_path = python_path(folders, repo, foreign_python)
    result = subprocess.run([sys.executable, "-c", code, json.dumps(names)], check=True, text=True,
                            capture_output=True, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    return json.loads(result.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("work", type=Path)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--foreign-python", action="store_true")
    args = parser.parse_args(argv)
    folders = unpack(args.bundle, args.work, args.foreign_python)
    missing = missing_requirements(folders, args.repo, args.foreign_python)
    (args.work / "missing_requirements.json").write_text(json.dumps(missing) + "\n")
    print(f"export PYTHONPATH={python_path(folders, args.repo, args.foreign_python)}")
    print(f"export KVEVICT_GPU_MODEL_DIR={folders['model']}")
    if missing:
        print(f"# vLLM requirements missing on this path: {' '.join(missing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
