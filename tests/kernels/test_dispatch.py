"""Backend choice CUDA -> Triton -> torch, its override, and each CPU-runnable backend vs the reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import BLOCK_SIZE, compaction_plan

from vllm_kvevict.layout.kernels import BACKEND_ENV, dispatch, reference

HERE = Path(__file__).resolve().parent
CPU = torch.device("cpu")


@pytest.fixture
def plain_cpu(monkeypatch):
    """No override and no Triton interpreter: what a CPU-only vLLM worker sees."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("op", sorted(dispatch.OPS))
def test_auto_on_cpu_without_interpreter_picks_torch(plain_cpu, op):
    assert dispatch.choose_backend(op, CPU) == "torch"


@pytest.mark.parametrize("op", sorted(dispatch.OPS))
def test_auto_on_cpu_with_interpreter_picks_triton(plain_cpu, monkeypatch, op):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.choose_backend(op, CPU) == "triton"


def test_environment_variable_forces_torch(plain_cpu, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert dispatch.choose_backend("compact_subblocks", CPU) == "torch"


def test_argument_overrides_environment_variable(plain_cpu, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert dispatch.choose_backend("paged_window_scores", CPU, backend="triton") == "triton"


def test_unknown_backend_is_named_with_the_valid_ones(plain_cpu, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cutlass")
    with pytest.raises(
        ValueError, match=r"KVEVICT_KERNEL_BACKEND='cutlass'.*\('auto', 'cuda', 'triton', 'torch'\)"
    ):
        dispatch.choose_backend("compact_subblocks", CPU)


def test_requesting_triton_where_it_cannot_run_is_an_error_not_a_fallback(plain_cpu):
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.choose_backend("ragged_paged_attention", CPU, backend="triton")


def test_requesting_cuda_on_cpu_is_an_error(plain_cpu):
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        dispatch.choose_backend("compact_subblocks", CPU, backend="cuda")


def test_cuda_request_continues_to_triton_for_ops_without_a_cuda_kernel(plain_cpu, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.choose_backend("ragged_paged_attention", CPU, backend="cuda") == "triton"


def test_unknown_op_is_rejected():
    with pytest.raises(ValueError, match="unknown paged op 'copy_blocks'"):
        dispatch.choose_backend("copy_blocks", CPU)


def test_torch_path_compacts_like_the_reference(plain_cpu):
    caches = [torch.randn(2, 8, BLOCK_SIZE, 16) for _ in range(2)]
    expected = [c.clone() for c in caches]
    src, dst, layer = compaction_plan(2, 8, BLOCK_SIZE, kept_fraction=0.5)
    reference.compact_subblocks(expected, src, dst, layer)
    assert dispatch.compact_subblocks(caches, src, dst, layer) == "torch"
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)


def test_triton_backend_matches_reference_under_the_interpreter():
    """Runs parity_cases.py in a fresh interpreter with TRITON_INTERPRET=1 (Triton reads it at import)."""
    env = {k: v for k, v in os.environ.items() if k != BACKEND_ENV}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(HERE / "parity_cases.py"),
            "-q",
            "-p",
            "no:cacheprovider",
            "--confcutdir",
            str(HERE),
        ],
        cwd=HERE.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 20 and "skipped" not in summary, summary
