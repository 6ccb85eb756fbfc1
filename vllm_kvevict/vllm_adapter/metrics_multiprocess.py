"""Make metrics recorded in the EngineCore and worker processes reach the API server's ``/metrics``.

vLLM 0.32 serves ``/metrics`` from the API server process with ``get_prometheus_registry()``
(``vllm/v1/metrics/prometheus.py``): the global in-memory registry, unless ``PROMETHEUS_MULTIPROC_DIR`` is
set, in which case a ``MultiProcessCollector`` reads every process's value files. vLLM itself sets that
variable only for ``--api-server-count > 1`` (``run_multi_api_server`` in
``vllm/entrypoints/cli/serve.py``); with the default single API server, values written in EngineCore
(scheduler) and the worker (a separate process on CPU, ``mp`` executor) never show. vLLM's own metrics are
built for the multi-process mode (their gauges declare ``multiprocess_mode``), so switching it on for every
process keeps them and adds ours. Lost in that mode, as in vLLM's own multi-server mode: the API server's
``process_*``/``python_gc_*`` default collectors.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path

from prometheus_client import values

# Under "vllm." so that vLLM's logging configuration (handlers, level) shows it.
logger = logging.getLogger("vllm.kvevict.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> Path | None:
    """The directory processes write their metric values to, if multi-process collection is on."""
    directory = os.environ.get(MULTIPROC_ENV)
    return Path(directory) if directory else None


def ensure_multiprocess_collection() -> Path:
    """Turn on prometheus_client's multi-process mode in this process and every process it starts.

    Call it in the first vLLM process (the API server, from the plugin while the CLI parser is built) before
    any metric is created; vLLM creates its metrics only after argument parsing. Where the variable is already
    set (by the user, or inherited by EngineCore/workers), only this process's value class is checked.
    The directory made here is removed when the process that made it exits.
    """
    existing = multiprocess_dir()
    if existing is None:
        existing = Path(tempfile.mkdtemp(prefix="vllm-kvevict-metrics-"))
        os.environ[MULTIPROC_ENV] = str(existing)
        atexit.register(shutil.rmtree, existing, ignore_errors=True)
        logger.info("kv-eviction metrics: multi-process Prometheus collection in %s", existing)
    existing.mkdir(parents=True, exist_ok=True)
    # prometheus_client picks its value class once, at import; re-pick it now that the variable is set.
    if not getattr(values.ValueClass, "_multiprocess", False):
        values.ValueClass = values.get_value_class()
    return existing
