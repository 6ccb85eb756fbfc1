"""Shared fixtures: the prepared bundled model, and how test servers use the machine's cores.

Every server a test starts goes through ``vllm_kvevict.cli.server_process.VLLMServer``, which applies
``vllm_kvevict.cpu_setup`` (``--dtype`` from the CPU's capabilities, tcmalloc when present) and logs the
choice in one line.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def all_cores_bind() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` value naming every core this process may run on, e.g. ``0,1``."""
    return ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))


@pytest.fixture(scope="session", autouse=True)
def servers_use_every_core() -> Iterator[None]:
    """Test servers run their model on every core (unless ``VLLM_CPU_OMP_THREADS_BIND`` is already set).

    vLLM's CPU default binds one core per rank and leaves the rest to the API server and scheduler; on the
    two-core CI machine that halves the prefill speed of every end-to-end test (measured: a 4064-token
    prompt took 65 s with the default binding, 32 s with both cores). The tests check behaviour, not
    speed; benchmarks keep vLLM's default binding.
    """
    if OMP_BIND_ENV in os.environ:
        yield
        return
    os.environ[OMP_BIND_ENV] = all_cores_bind()
    try:
        yield
    finally:
        os.environ.pop(OMP_BIND_ENV, None)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """Directory of the converted, verified SmolLM2-135M-Instruct (converted on first use, then instant)."""
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    return prepared_model_dir()
