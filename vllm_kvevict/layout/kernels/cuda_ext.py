"""The CUDA compaction op from ``csrc/``: JIT build where CUDA exists, and the compile-only commands.

``torch.ops.kvevict.compact_slots(caches, src_slots, dst_slots, layer_idx)`` is built once per machine by
``torch.utils.cpp_extension.load`` (cached under ``TORCH_EXTENSIONS_DIR``). Without a CUDA device or
without the sources (a wheel install ships no ``csrc/``) it is simply unavailable and dispatch falls back.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parents[3] / "csrc"
KERNEL_SOURCE = CSRC / "compaction_kernels.cu"
BINDING_SOURCE = CSRC / "compaction_op.cpp"
# nvcc targets for the compile-only check: Ampere and Hopper, the GPUs this project runs on
CHECK_ARCHS = ("sm_80", "sm_90")


def unavailable_reason(device: torch.device) -> str | None:
    """Why the CUDA op cannot run on ``device``, or None when it can (building it if needed)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the CUDA compaction op needs a CUDA device, got {device}"
    if torch.version.cuda is None:
        return "this torch build has no CUDA"
    if not KERNEL_SOURCE.exists() or not BINDING_SOURCE.exists():
        return f"the CUDA sources are not at {CSRC} (installed without csrc/)"
    return _build_error()


@functools.cache
def _build_error() -> str | None:
    """Build once per process; a failure is remembered so dispatch does not rebuild on every call."""
    try:
        load_compaction_op()
    except Exception as exc:  # a failed JIT build must fall back, not take the server down
        return f"building the CUDA compaction op failed: {exc}"
    return None


@functools.cache
def load_compaction_op() -> Callable[..., None]:
    """Build (once) and load ``torch.ops.kvevict.compact_slots``."""
    from torch.utils.cpp_extension import load

    load(
        name="kvevict_compaction",
        sources=[str(BINDING_SOURCE), str(KERNEL_SOURCE)],
        extra_include_paths=[str(CSRC)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.kvevict.compact_slots


def torch_include_dirs() -> list[Path]:
    """Header directories of the installed torch (CPU wheels ship CUDA headers too, minus generated ones)."""
    from torch.utils.cpp_extension import include_paths

    return [Path(p) for p in include_paths()]


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def cuda_include_dir(nvcc: str) -> Path:
    """The CUDA toolkit's include directory (nvcc may be a wrapper script outside the toolkit)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    roots = [Path(c) for c in candidates if c] + [Path(nvcc).resolve().parent.parent]
    for root in roots:
        if (root / "include" / "cuda_runtime.h").exists():
            return root / "include"
    raise FileNotFoundError(f"no CUDA include directory with cuda_runtime.h under {[str(r) for r in roots]}")


def compile_only_commands(out_dir: Path, shim_dir: Path) -> list[list[str]]:
    """Commands that compile the CUDA sources without a GPU or a CUDA torch.

    1. nvcc compiles the kernel translation unit (no torch headers) to an object and to PTX per arch.
    2. g++ checks the torch binding with torch's headers. CPU wheels of torch lack the CMake-generated
       ``c10/cuda/impl/cuda_cmake_macros.h``; ``shim_dir`` must hold that one-line header (write it with
       ``write_cmake_macros_shim``). The binding's CUDA calls come from the CUDA toolkit headers next to nvcc.
    """
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH")
    cuda_include = cuda_include_dir(nvcc)
    def nvcc_kernel(mode: str, out: str) -> list[str]:
        return [nvcc, mode, str(KERNEL_SOURCE), "-o", str(out_dir / out), "-std=c++17"]

    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in CHECK_ARCHS]
    commands = [[*nvcc_kernel("-c", "compaction_kernels.o"), "-O3", *gencode]]
    commands += [[*nvcc_kernel("-ptx", f"compaction_kernels_{a}.ptx"), f"-arch={a}"] for a in CHECK_ARCHS]
    gxx = shutil.which("g++") or "g++"
    includes = [f"-I{shim_dir}", *[f"-I{p}" for p in torch_include_dirs()], f"-I{cuda_include}", f"-I{CSRC}"]
    commands.append([gxx, "-fsyntax-only", "-std=c++20", *includes, str(BINDING_SOURCE)])
    return commands


def write_cmake_macros_shim(shim_dir: Path) -> None:
    """The header CUDA builds of torch generate at CMake time (see ``compile_only_commands``)."""
    header = shim_dir / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    header.parent.mkdir(parents=True, exist_ok=True)
    header.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
