"""Shared fixtures: the prepared bundled model, and how test servers share the machine's cores.

Every server a test starts goes through ``vllm_kvevict.server_process.VLLMServer``, which applies
``vllm_kvevict.cpu_setup`` (``--dtype`` from the CPU's capabilities, tcmalloc when present) and logs the
choice in one line.

``make test`` runs the suite in pytest-xdist workers (``-n 2 --dist loadfile``). Each worker's servers run
their model on that worker's share of the cores, so two servers never contend for one core; one module's
tests stay on one worker (they share its server and module fixtures), and so do all of ``tests/reliability``
(they share the session-scoped server of ``tests/reliability/conftest.py``). The slowest scopes are dealt
out first (``SLOWEST_FIRST``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from suite_schedule import schedule_rank, scope_of

OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
#: File to which every worker appends "worker start end nodeid" (seconds since the epoch) per test: how the
#: workers' time was spent, for ``suite_schedule.SLOWEST_FIRST``. Unset: nothing is written.
TIMELINE_ENV = "KVEVICT_SUITE_TIMELINE"


def worker_cores(worker: int, workers: int) -> list[int]:
    """The cores of xdist worker ``worker`` of ``workers``: every ``workers``-th core this process may use
    (all of them outside xdist), at least one."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[worker::workers] or [cores[worker % len(cores)]]


def xdist_worker() -> tuple[int, int]:
    """(this worker's index, number of workers); (0, 1) outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name.removeprefix("gw")), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


@pytest.fixture(scope="session", autouse=True)
def servers_bind_their_cores() -> Iterator[None]:
    """Test servers run their model on this worker's cores (unless ``VLLM_CPU_OMP_THREADS_BIND`` is set).

    vLLM's CPU default binds one core per rank (the same core for every server) and leaves the rest to the
    API server and scheduler. Alone, a server given both cores of the CI machine prefilled a 4064-token
    prompt in 32 s instead of 65 s; under xdist each worker's servers get a core of their own. The tests
    check behaviour, not speed; benchmarks keep vLLM's default binding. In the worker's own process, torch
    (the HF reference) uses as many threads as the worker has cores.
    """
    if OMP_BIND_ENV in os.environ:
        yield
        return
    worker, workers = xdist_worker()
    cores = worker_cores(worker, workers)
    os.environ[OMP_BIND_ENV] = ",".join(map(str, cores))
    if workers > 1:
        import torch

        torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.environ.pop(OMP_BIND_ENV, None)


@pytest.fixture(scope="session")
def rank_binding() -> Callable[[int], str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a server of N ranks: one core each, taken in turn from this worker's
    cores, so that a tensor-parallel server stays on its worker's share of the machine.

    Measured alone on two cores, a TP=3 server started in 59 s spread over both cores (``0|1|0``) and in 78 s
    on one (``0|0|0``); under xdist the test on the spread one took 369 s (its start-up and four requests),
    its rank on the other worker's core waiting behind that worker's server at every all-reduce.
    """

    def binding(ranks: int) -> str:
        cores = worker_cores(*xdist_worker())
        return "|".join(str(cores[rank % len(cores)]) for rank in range(ranks))

    return binding


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slowest server-starting scopes first (a stable sort: each module keeps its own order)."""
    items.sort(key=lambda item: schedule_rank(item.nodeid))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: pytest without xdist must not reject it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``--dist loadfile``: a module is a scope except the ``ONE_SCOPE`` directories, and scopes are
    dealt out in collection order (``SLOWEST_FIRST``), not xdist's default of most tests first."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ServerScopes(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False
    return ServerScopes(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With ``KVEVICT_SUITE_TIMELINE`` set, one line per test (setup, call and teardown together)."""
    path = os.environ.get(TIMELINE_ENV)
    started = time.time()
    try:
        return (yield)
    finally:
        if path:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            with open(path, "a") as timeline:
                timeline.write(f"{worker} {started:.1f} {time.time():.1f} {item.nodeid}\n")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """Directory of the converted, verified SmolLM2-135M-Instruct (converted on first use, then instant)."""
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    return prepared_model_dir()


@pytest.fixture(scope="session")
def qwen_model_dir() -> Path:
    """Directory of the converted, verified Qwen2.5-Coder-0.5B-Instruct (``make test`` prepares it first)."""
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    return prepared_model_dir(model="qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma_model_dir() -> Path:
    """Directory of the converted, verified Gemma 3 270M base model (its GGUF split over four data wheels)."""
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    return prepared_model_dir(model="gemma3-270m")
