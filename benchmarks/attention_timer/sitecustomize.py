"""Times vLLM's CPU attention kernel in a benchmark's server (``prefix_profile.py``): imported at start-up
because the benchmark puts this folder first on the server's ``PYTHONPATH``; does nothing unless
``KVEVICT_ATTENTION_TIMES`` names a file.

It wraps ``vllm._custom_ops.cpu_attention_with_kv_cache`` (looked up by attribute at every call, by vLLM's
CPU backend and by ours) once the module is imported, and after every call rewrites the file with, per batch
kind (query heads per sequence: the model's for vLLM's layout, a KV head's group for head-as-sequence;
decode-only or with prefill rows), the calls, kernel seconds, query rows and work units
(Σ query rows × context length × query heads). Timing only: arguments and results are passed through.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

_PATH = os.environ.get("KVEVICT_ATTENTION_TIMES")


def _install(ops) -> None:
    kernel = ops.cpu_attention_with_kv_cache
    totals: dict[str, list[float]] = {}
    lock = threading.Lock()

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = kernel(*args, **kwargs)
        seconds = time.perf_counter() - start
        query, starts, lengths = kwargs["query"], kwargs["query_start_loc"], kwargs["seq_lens"]
        rows = (starts[1:] - starts[:-1]).long()
        batch = "decode only" if bool((rows == 1).all()) else "with prefill"
        kind = f"{query.shape[1]} query heads/seq, {batch}"
        work = int((rows * lengths.long()).sum()) * query.shape[1]
        with lock:
            entry = totals.setdefault(kind, [0, 0.0, 0, 0])
            entry[0] += 1
            entry[1] += seconds
            entry[2] += int(query.shape[0])
            entry[3] += work
            partial = f"{_PATH}.{os.getpid()}.tmp"
            with open(partial, "w") as out:
                json.dump(totals, out)
            os.replace(partial, _PATH)
        return result

    ops.cpu_attention_with_kv_cache = timed


def _wait_for_vllm() -> None:
    while True:
        ops = sys.modules.get("vllm._custom_ops")
        if ops is not None and hasattr(ops, "cpu_attention_with_kv_cache"):
            _install(ops)
            return
        time.sleep(0.05)


if _PATH:
    threading.Thread(target=_wait_for_vllm, name="attention-timer", daemon=True).start()
