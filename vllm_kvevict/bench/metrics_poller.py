"""Polls a vLLM server's ``/metrics`` in a thread and keeps the peaks the benchmark reports."""

from __future__ import annotations

import threading
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions"  # a counter family: its sample is ..._total
PROMPT_TOKENS = "vllm:prompt_tokens"  # counter
GENERATION_TOKENS = "vllm:generation_tokens"  # counter


@dataclass
class Peaks:
    """Peaks of the polled gauges, plus the running-request sum for the time average (long outputs: the
    pool limits how many requests keep running, not how many start) and the last preemption count.

    max_kv_usage_decoding: the peak KV usage over polls during which tokens were generated and no prompt
    was admitted (decode only)."""

    max_running: float = 0.0
    max_waiting: float = 0.0
    max_kv_usage: float = 0.0
    samples: int = 0
    sum_running: float = 0.0
    preemptions: float = 0.0
    max_kv_usage_decoding: float = 0.0

    @property
    def mean_running(self) -> float:
        """Running requests averaged over the samples (polled every ``interval_s``)."""
        return self.sum_running / self.samples if self.samples else 0.0


def gauge_values(metrics_text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each named gauge over its label sets (one engine: one series)."""
    values = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        if family.name in values:
            values[family.name] = sum(sample.value for sample in family.samples)
    return values


class MetricsPoller:
    """Context manager: polls ``{base_url}/metrics`` every ``interval_s`` until closed."""

    def __init__(self, metrics_url: str, interval_s: float = 0.25) -> None:
        self.metrics_url = metrics_url
        self.interval_s = interval_s
        self.peaks = Peaks()
        self._last: tuple[float, float] | None = None  # (prompt tokens, generated tokens) at the last poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-poller", daemon=True)

    def __enter__(self) -> MetricsPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def poll_once(self) -> None:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        values = gauge_values(
            text, (RUNNING, WAITING, KV_USAGE, PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS)
        )
        self._count_tokens(values)
        self.peaks.max_running = max(self.peaks.max_running, values[RUNNING])
        self.peaks.sum_running += values[RUNNING]
        self.peaks.preemptions = max(self.peaks.preemptions, values[PREEMPTIONS])
        self.peaks.max_waiting = max(self.peaks.max_waiting, values[WAITING])
        self.peaks.max_kv_usage = max(self.peaks.max_kv_usage, values[KV_USAGE])
        self.peaks.samples += 1

    def _count_tokens(self, values: dict[str, float]) -> None:
        prompt, generated = values[PROMPT_TOKENS], values[GENERATION_TOKENS]
        if self._last is not None:
            last_prompt, last_generated = self._last
            if prompt == last_prompt and generated > last_generated:
                self.peaks.max_kv_usage_decoding = max(self.peaks.max_kv_usage_decoding, values[KV_USAGE])
        self._last = (prompt, generated)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except OSError:
                pass  # a slow scrape under load; the next one counts
            self._stop.wait(self.interval_s)
