"""The Triton kernels compile to cubin for Hopper and Ampere on this GPU-less machine (see triton_aot.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from triton_aot import QUICK

HERE = Path(__file__).resolve().parent


def test_triton_kernels_compile_for_sm90_and_sm80(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")  # a real compile, no reuse
    result = subprocess.run(
        [sys.executable, str(HERE / "triton_aot.py"), "--quick", "--arch", "90", "80"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("OK sm_")]
    assert len(compiled) == 2 * len(QUICK), result.stdout
