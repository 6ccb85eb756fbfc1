"""The bundle's downloads, cached: the official vLLM wheel and the pinned wheels the GPU host lacks.

Measured on the development machine (2026-11-27): ``vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl`` is
326.5 MB and downloaded in 4 s; the 32 pinned wheels (19.2 MiB) in 4 s. A cache hit costs nothing, so CI
downloads once per machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VLLM_VERSION = "0.32.0"
VLLM_WHEEL_GLOB = f"vllm-{VLLM_VERSION}-*.whl"
PINNED_WHEELS = Path(__file__).with_name("wheels.txt")
#: The GPU host's interpreter and platform; llguidance is published for manylinux_2_31 only.
TARGET_TAGS = (
    "--python-version", "3.12", "--implementation", "cp",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
    "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_31_x86_64",
)


def cache_dir() -> Path:
    """``$KVEVICT_CACHE_DIR/gpu-bundle``, else ``$XDG_CACHE_HOME/vllm-kvevict/gpu-bundle``, else under
    ``~/.cache`` (the same root as the prepared model)."""
    if os.environ.get("KVEVICT_CACHE_DIR"):
        root = Path(os.environ["KVEVICT_CACHE_DIR"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-kvevict"
    return root / "gpu-bundle"


def pinned_requirements(path: Path = PINNED_WHEELS) -> list[str]:
    """``name==version`` lines of ``wheels.txt`` (comments and blank lines skipped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def _pip_download(dest: Path, args: list[str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    subprocess.run([*command, *args], check=True, stdout=subprocess.DEVNULL)


def vllm_wheel(cache: Path | None = None) -> Path:
    """The official ``vllm==0.32.0`` wheel (the CUDA build, vLLM's own), downloaded once into the cache."""
    dest = (cache or cache_dir()) / "vllm"
    found = sorted(dest.glob(VLLM_WHEEL_GLOB))
    if not found:
        _pip_download(dest, [f"vllm=={VLLM_VERSION}"])
        found = sorted(dest.glob(VLLM_WHEEL_GLOB))
    if len(found) != 1:
        raise RuntimeError(f"expected one {VLLM_WHEEL_GLOB} in {dest}, found {[p.name for p in found]}")
    return found[0]


def _wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return name.lower().replace("_", "-"), version


def _normalized(requirement: str) -> tuple[str, str]:
    name, version = requirement.split("==")
    return name.strip().lower().replace("_", "-").replace(".", "-"), version.strip()


def pinned_wheels(cache: Path | None = None, requirements: list[str] | None = None) -> list[Path]:
    """One cp312 manylinux wheel per pinned requirement, downloaded once into the cache; raises when a
    requirement has no wheel afterwards."""
    requirements = requirements if requirements is not None else pinned_requirements()
    dest = (cache or cache_dir()) / "wheels"
    wanted = dict(_normalized(r) for r in requirements)

    def present() -> dict[str, Path]:
        have = {}
        for path in dest.glob("*.whl"):
            name, version = _wheel_name_version(path)
            name = name.replace(".", "-")
            if wanted.get(name) == version:
                have[name] = path
        return have

    have = present() if dest.is_dir() else {}
    missing = [r for r in requirements if _normalized(r)[0] not in have]
    if missing:
        _pip_download(dest, [*TARGET_TAGS, *missing])
        have = present()
    still = sorted(set(wanted) - set(have))
    if still:
        raise RuntimeError(f"no wheel downloaded for {still} in {dest}")
    return sorted(have.values())
