"""The CUDA compaction sources compile with the nvcc on this machine (compile-only: no GPU, CPU torch)."""

from __future__ import annotations

import re
import subprocess

import pytest

from vllm_kvevict.layout.kernels import cuda_ext


@pytest.mark.skipif(cuda_ext.nvcc_path() is None, reason="nvcc is not on PATH")
def test_cuda_compaction_sources_compile(tmp_path):
    cuda_ext.write_cmake_macros_shim(tmp_path / "shim")
    commands = cuda_ext.compile_only_commands(tmp_path, tmp_path / "shim")
    for command in commands:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-4000:]}"
    assert (tmp_path / "compaction_kernels.o").stat().st_size > 0
    for arch in cuda_ext.CHECK_ARCHS:
        ptx = (tmp_path / f"compaction_kernels_{arch}.ptx").read_text()
        # 5 vector widths x 2 directions; the 16-byte path loads and stores 128 bits in both directions
        assert ptx.count(".entry") == 10, ptx[:400]
        vector_ops = re.findall(r"\b(?:ld|st)(?:\.global)?(?:\.nc)?\.v4\.u32", ptx)
        assert len(vector_ops) == 4, vector_ops
