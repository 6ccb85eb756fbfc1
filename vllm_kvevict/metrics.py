"""Prometheus metrics of KV eviction, all prefixed ``vllm_kvevict_``, served on vLLM's own ``/metrics``.

Recording happens where eviction happens: the worker (compaction, budgets, step time) and the EngineCore
(blocks the scheduler side keeps free). Those processes are not the API server that serves ``/metrics``, so
the values travel through prometheus_client's multi-process files (``PROMETHEUS_MULTIPROC_DIR``, see
``metrics_multiprocess``); every gauge therefore declares how processes combine.

Token counts are "token positions per KV head": for one request, ``kept_tokens`` is the mean over layers and
KV heads of the entries kept (``Σ_l Σ_h B_h / (L·H)``), directly comparable with the prompt length.

The module-level ``record_*``/``observe_*``/``set_*`` functions are the recording API; they build the metrics
on first use, so a server without eviction never creates a series and pays nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Concatenate, ParamSpec

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "vllm_kvevict_"

P = ParamSpec("P")

#: kept / prompt tokens of one request (1.0 = nothing evicted).
KEPT_RATIO_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)
#: seconds one eviction step spends scoring / compacting.
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: B_h / B: one KV head's kept entries over the layer's mean per head (1.0 = uniform budgets).
HEAD_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)

#: why a policy's selection was replaced by the most recent tokens (datapath/policy_guard.py).
FALLBACK_REASONS = ("raised", "wrong_counts", "nan_scores")
#: phases an eviction step's host time is reported for (datapath/records.py ``StepTimer``): ``selection`` =
#: the policies' scoring and selection, ``total`` = all of the datapath's work after attention (selection,
#: held entries, sub-block assignment and the moves' slots); the dashboard shows exactly these
#: (test_deploy_files.py).
STEP_PHASES = ("total", "selection")


#: events of ``vllm_kvevict_kept_contexts_total``: a creator's context entered the prefix cache / was read.
CONTEXT_EVENTS = ("kept", "read")


class EvictionMetrics:
    """Every eviction metric, in one registry (the global one in production, a fresh one in tests)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def latest(name: str, text: str, labels: Sequence[str] = ()) -> Gauge:
            """A gauge whose value across processes is the one set last."""
            return Gauge(PREFIX + name, text, labels, registry=registry, multiprocess_mode="mostrecent")

        def per_method(name: str, text: str) -> Counter:
            return Counter(PREFIX + name, text, ["method"], registry=registry)

        self.requests_compacted = per_method(
            "requests_compacted", "Requests whose KV cache was compacted after prefill.",
        )
        self.requests_skipped = per_method(
            "requests_skipped",
            "Requests left untouched: their prompt (or their part after a shared prefix) fits the budget, or "
            "compacting that part would free less than min_freed_share of the prompt.",
        )
        self.tokens_kept = Counter(
            PREFIX + "tokens_kept", "Prompt tokens kept per KV head (mean over layers and heads).",
            registry=registry,
        )
        self.tokens_evicted = Counter(
            PREFIX + "tokens_evicted", "Prompt tokens evicted per KV head (mean over layers and heads).",
            registry=registry,
        )
        self.blocks_freed = Counter(
            PREFIX + "blocks_freed", "Paged KV blocks given back to vLLM's pool after compaction.",
            registry=registry,
        )
        self.kept_ratio = Histogram(
            PREFIX + "kept_ratio",
            "Compression ratio per compacted request, as kept / prompt tokens (1 = nothing evicted).",
            buckets=KEPT_RATIO_BUCKETS, registry=registry,
        )
        self.step_seconds = Histogram(
            PREFIX + "eviction_step_seconds",
            "Time of the eviction work in one engine step (phase: total, or selection = the policies' "
            "scoring and selection).",
            ["phase"], buckets=STEP_SECONDS_BUCKETS, registry=registry,
        )
        self.head_budget_ratio = Histogram(
            PREFIX + "head_budget_ratio",
            "Spread of per-head budgets: B_h / B for every (layer, KV head) of a compacted request.",
            buckets=HEAD_RATIO_BUCKETS, registry=registry,
        )
        self.kv_tokens_resident = latest(
            "kv_tokens_resident",
            "KV tokens per KV head resident for running compacted requests after eviction.",
        )
        self.kv_blocks_saved = latest(
            "kv_blocks_saved",
            "Blocks running requests would hold in addition without eviction.",
        )
        self.kv_bytes_saved = latest(
            "kv_bytes_saved",
            "Bytes of KV cache (all layers of this worker, in the cache's own dtype: 1 byte per element for "
            "--kv-cache-dtype fp8) running requests would hold in addition without eviction.",
        )
        self.kv_cache_saved_perc = latest(
            "kv_cache_saved_perc",
            "Fraction of the KV pool running requests would hold in addition without eviction (1 = 100%).",
        )
        self.layer_kept_budget = latest(
            "layer_kept_budget",
            "Kept tokens per KV head of each layer for the most recently compacted request.",
            ["layer"],
        )
        self.decode_evictions = per_method(
            "decode_evictions",
            "Decode-time re-scores: a capped request evicted down to its cap while generating (all layers).",
        )
        self.decode_tokens_evicted = per_method(
            "decode_tokens_evicted",
            "Entries per KV head evicted while generating (the rule's bound, summed over re-scores).",
        )
        self.decode_blocks_freed = per_method(
            "decode_blocks_freed",
            "Paged KV blocks given back to vLLM's pool while generating (decode-time cap).",
        )
        self.policy_fallbacks = Counter(
            PREFIX + "policy_fallbacks",
            "Layers of a request whose policy failed (reason) and kept the most recent tokens instead.",
            ["method", "reason"], registry=registry,
        )
        self.contexts = Counter(
            PREFIX + "kept_contexts",
            "Compacted contexts (kv_context: keep): kept = entered vLLM's prefix cache by a creator, "
            "read = a later request started from one instead of computing its context.",
            ["event"], registry=registry,
        )
        self.worker_requests = latest(
            "worker_requests",
            "Requests whose compacted KV layout the worker holds (0 once all requests are gone: no leak).",
        )
        # An info metric by convention (``*_info`` = 1): prometheus_client's Info does not work multi-process.
        self.config_info = Gauge(
            PREFIX + "config_info", "Active eviction method and budget (value is always 1).",
            ["method", "budget", "params"], registry=registry, multiprocess_mode="max",
        )

    def record_eviction_config(self, method: str, budget: int | float, params: Mapping[str, object]) -> None:
        """Publish the active method, budget and parameters (call once per process that evicts)."""
        params_text = ",".join(f"{key}={params[key]}" for key in sorted(params))
        self.config_info.labels(method=method, budget=str(budget), params=params_text).set(1)
        for reason in FALLBACK_REASONS:  # series at 0 from the start: a rate() panel shows 0, not "no data"
            self.policy_fallbacks.labels(method=method, reason=reason)

    def record_policy_fallback(self, method: str, reason: str) -> None:
        """One layer of one request fell back to its most recent tokens because its policy failed."""
        if reason not in FALLBACK_REASONS:
            raise ValueError(f"reason={reason!r} is not one of {', '.join(FALLBACK_REASONS)}")
        self.policy_fallbacks.labels(method=method, reason=reason).inc()

    def record_request_compacted(
        self,
        method: str,
        prompt_tokens: int,
        kept_tokens: float,
        layer_budgets: Sequence[float],
        head_budget_ratios: Sequence[float],
        blocks_freed: int,
    ) -> None:
        """One request compacted after prefill.

        kept_tokens: mean kept entries per KV head over all layers (``Σ_l Σ_h B_h / (L·H)``).
        layer_budgets: ``[num_layers]`` mean kept entries per KV head of each layer.
        head_budget_ratios: ``B_h / B_layer`` for every (layer, KV head), flattened;
            ``[]`` for uniform methods.
        blocks_freed: leading blocks the accounting rule frees for this request.
        """
        if prompt_tokens <= 0 or not 0 <= kept_tokens <= prompt_tokens:
            raise ValueError(f"kept_tokens={kept_tokens} must lie in [0, prompt_tokens={prompt_tokens}]")
        if blocks_freed < 0:
            raise ValueError(f"blocks_freed={blocks_freed} must be >= 0")
        self.requests_compacted.labels(method=method).inc()
        self.tokens_kept.inc(kept_tokens)
        self.tokens_evicted.inc(prompt_tokens - kept_tokens)
        self.blocks_freed.inc(blocks_freed)
        self.kept_ratio.observe(kept_tokens / prompt_tokens)
        for layer, budget in enumerate(layer_budgets):
            self.layer_kept_budget.labels(layer=str(layer)).set(budget)
        for ratio in head_budget_ratios:
            self.head_budget_ratio.observe(ratio)

    def record_request_skipped(self, method: str) -> None:
        """One request not compacted: its prompt fits the budget, or its part after a shared prefix would free
        less than ``min_freed_share`` of it."""
        self.requests_skipped.labels(method=method).inc()

    def record_decode_eviction(self, method: str, tokens_evicted: float, blocks_freed: int) -> None:
        """One decode-time re-score of a capped request (every layer): entries per KV head evicted, blocks the
        rule frees for it (decode method ``method``)."""
        if tokens_evicted < 0 or blocks_freed < 0:
            raise ValueError(f"tokens_evicted={tokens_evicted} and blocks_freed={blocks_freed} must be >= 0")
        self.decode_evictions.labels(method=method).inc()
        self.decode_tokens_evicted.labels(method=method).inc(tokens_evicted)
        self.decode_blocks_freed.labels(method=method).inc(blocks_freed)

    def record_decode_config(self, method: str) -> None:
        """The decode-time method of this worker: its series at 0 from the start, so the dashboard's rate()
        panels show 0, not "no data"."""
        for counter in (self.decode_evictions, self.decode_tokens_evicted, self.decode_blocks_freed):
            counter.labels(method=method)

    def observe_eviction_step(self, seconds: float, phase: str = "total") -> None:
        """Time one engine step spent on eviction; ``phase`` is one of ``STEP_PHASES``."""
        if phase not in STEP_PHASES:
            raise ValueError(f"phase={phase!r} is not one of {', '.join(STEP_PHASES)}")
        self.step_seconds.labels(phase=phase).observe(seconds)

    def set_kv_tokens_resident(self, tokens: float) -> None:
        """KV tokens per KV head now resident for all running compacted requests (after eviction)."""
        self.kv_tokens_resident.set(tokens)

    def record_context(self, event: str) -> None:
        """A creator's compacted context entered the prefix cache (``kept``), or a request started from a kept
        context instead of computing it (``read``); scheduler side."""
        if event not in CONTEXT_EVENTS:
            raise ValueError(f"event={event!r} is not one of {', '.join(CONTEXT_EVENTS)}")
        self.contexts.labels(event=event).inc()

    def start_kept_contexts(self) -> None:
        """Create the kept-context series at 0 (scheduler side, once the evicting manager exists)."""
        for event in CONTEXT_EVENTS:  # series at 0 from the start: a rate() panel shows 0, not "no data"
            self.contexts.labels(event=event)

    def set_worker_requests(self, count: int) -> None:
        """Requests whose eviction state (sub-block tables) the worker holds after a step."""
        self.worker_requests.set(count)

    def set_kv_cache_saved(self, saved_blocks: int, total_blocks: int, block_bytes: int = 0) -> None:
        """Blocks running requests would hold in addition without eviction, the pool size and one block's
        bytes over all layers (scheduler side)."""
        if total_blocks <= 0:
            raise ValueError(f"total_blocks={total_blocks} must be > 0")
        self.kv_blocks_saved.set(saved_blocks)
        self.kv_bytes_saved.set(saved_blocks * block_bytes)
        self.kv_cache_saved_perc.set(saved_blocks / total_blocks)


class _Discarded:
    """Takes every recording call of ``EvictionMetrics`` and records nothing (a muted process)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


_lock = threading.Lock()
_process_metrics: EvictionMetrics | None = None
_muted = False


def mute_this_process(muted: bool = True) -> None:
    """Stop (or resume) recording in this process. Tensor-parallel worker ranks other than 0 are muted: every
    rank compacts the same requests (each for its own KV heads), so counting on every rank would multiply
    the counters by the TP size. Multi-process values are written to files whatever the registry, hence a
    switch rather than a private registry."""
    global _muted
    _muted = muted


def process_metrics() -> EvictionMetrics:
    """This process's metrics in the global registry, built on first use (a sink when muted)."""
    global _process_metrics
    if _muted:
        return _Discarded()  # type: ignore[return-value]
    if _process_metrics is None:
        with _lock:
            if _process_metrics is None:
                _process_metrics = EvictionMetrics()
    return _process_metrics


def _forward(method: Callable[Concatenate[EvictionMetrics, P], None]) -> Callable[P, None]:
    """The module-level recording function of ``method``: it calls it on this process's metrics at call time
    (nothing when the process is muted)."""
    name = method.__name__

    def record(*args: P.args, **kwargs: P.kwargs) -> None:
        getattr(process_metrics(), name)(*args, **kwargs)

    record.__name__ = record.__qualname__ = name
    record.__doc__ = method.__doc__
    return record


record_eviction_config = _forward(EvictionMetrics.record_eviction_config)
record_request_compacted = _forward(EvictionMetrics.record_request_compacted)
record_request_skipped = _forward(EvictionMetrics.record_request_skipped)
record_decode_eviction = _forward(EvictionMetrics.record_decode_eviction)
record_decode_config = _forward(EvictionMetrics.record_decode_config)
record_policy_fallback = _forward(EvictionMetrics.record_policy_fallback)
observe_eviction_step = _forward(EvictionMetrics.observe_eviction_step)
set_kv_tokens_resident = _forward(EvictionMetrics.set_kv_tokens_resident)
set_worker_requests = _forward(EvictionMetrics.set_worker_requests)
set_kv_cache_saved = _forward(EvictionMetrics.set_kv_cache_saved)
start_kept_contexts = _forward(EvictionMetrics.start_kept_contexts)
record_context = _forward(EvictionMetrics.record_context)


def record_context_kept() -> None:
    """A creator's compacted context entered the prefix cache (scheduler side)."""
    record_context("kept")


def record_context_read() -> None:
    """A request started from a kept context instead of computing it (scheduler side)."""
    record_context("read")


def record_kept_per_head(
    method: str, prompt_tokens: int, kept_per_head: Sequence[Sequence[float]], blocks_freed: int
) -> None:
    """``record_request_compacted`` from the kept entry counts ``[num_layers][num_kv_heads]`` of a request
    (e.g. ``[k.counts.tolist() for k in kept]``): derives the mean, per-layer budgets and B_h / B ratios."""
    layer_budgets = [sum(heads) / len(heads) for heads in kept_per_head]
    ratios = [
        count / budget if budget > 0 else 1.0
        for heads, budget in zip(kept_per_head, layer_budgets, strict=True)
        for count in heads
    ]
    kept_tokens = sum(layer_budgets) / len(layer_budgets)
    record_request_compacted(method, prompt_tokens, kept_tokens, layer_budgets, ratios, blocks_freed)
