"""The eviction metrics: exact values in a real registry, and the multi-process path vLLM's /metrics reads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from vllm_kvevict.metrics import EvictionMetrics


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> EvictionMetrics:
    return EvictionMetrics(registry)


def compact_two_requests(metrics: EvictionMetrics) -> None:
    metrics.record_request_compacted("ada-snapkv", 4096, 1024.0, [1024.0, 1024.0], [0.5, 1.5, 1.0, 1.0], 46)
    metrics.record_request_compacted("ada-snapkv", 2048, 256.0, [300.0, 212.0], [0.2, 1.8, 0.9, 1.1], 26)


def test_compacted_requests_are_counted_by_method(metrics, registry):
    compact_two_requests(metrics)
    metrics.record_request_compacted("snapkv", 1000, 500.0, [], [], 3)
    assert registry.get_sample_value("vllm_kvevict_requests_compacted_total", {"method": "ada-snapkv"}) == 2
    assert registry.get_sample_value("vllm_kvevict_requests_compacted_total", {"method": "snapkv"}) == 1


def test_kept_and_evicted_tokens_add_up_to_prompt_tokens(metrics, registry):
    compact_two_requests(metrics)
    assert registry.get_sample_value("vllm_kvevict_tokens_kept_total") == 1280
    assert registry.get_sample_value("vllm_kvevict_tokens_evicted_total") == (4096 - 1024) + (2048 - 256)


def test_blocks_freed_accumulate(metrics, registry):
    compact_two_requests(metrics)
    assert registry.get_sample_value("vllm_kvevict_blocks_freed_total") == 72


def test_kept_ratio_histogram_observes_kept_over_prompt(metrics, registry):
    compact_two_requests(metrics)
    assert registry.get_sample_value("vllm_kvevict_kept_ratio_count") == 2
    assert registry.get_sample_value("vllm_kvevict_kept_ratio_sum") == pytest.approx(0.25 + 0.125)
    assert registry.get_sample_value("vllm_kvevict_kept_ratio_bucket", {"le": "0.15"}) == 1
    assert registry.get_sample_value("vllm_kvevict_kept_ratio_bucket", {"le": "0.25"}) == 2


def test_layer_budget_gauge_holds_the_latest_request_per_layer(metrics, registry):
    compact_two_requests(metrics)
    assert registry.get_sample_value("vllm_kvevict_layer_kept_budget", {"layer": "0"}) == 300
    assert registry.get_sample_value("vllm_kvevict_layer_kept_budget", {"layer": "1"}) == 212


def test_head_budget_spread_histogram_sees_every_head(metrics, registry):
    compact_two_requests(metrics)
    assert registry.get_sample_value("vllm_kvevict_head_budget_ratio_count") == 8
    assert registry.get_sample_value("vllm_kvevict_head_budget_ratio_bucket", {"le": "0.25"}) == 1
    assert registry.get_sample_value("vllm_kvevict_head_budget_ratio_bucket", {"le": "1.1"}) == 6


def test_kept_tokens_outside_the_prompt_are_rejected(metrics):
    with pytest.raises(ValueError, match="kept_tokens"):
        metrics.record_request_compacted("snapkv", 100, 101.0, [], [], 0)


def test_eviction_step_time_is_kept_as_the_total_phase(metrics, registry):
    metrics.observe_eviction_step(0.006)
    assert registry.get_sample_value("vllm_kvevict_eviction_step_seconds_sum", {"phase": "total"}) == 0.006
    assert registry.get_sample_value(
        "vllm_kvevict_eviction_step_seconds_bucket", {"phase": "total", "le": "0.005"}
    ) == 0
    assert registry.get_sample_value(
        "vllm_kvevict_eviction_step_seconds_bucket", {"phase": "total", "le": "0.01"}
    ) == 1


@pytest.mark.parametrize("phase", ["prefill", "scoring", "compaction"])
def test_a_phase_that_is_not_measured_is_rejected(metrics, phase):
    with pytest.raises(ValueError, match=f"phase='{phase}'"):
        metrics.observe_eviction_step(0.1, phase)


def test_cache_saved_is_published_as_blocks_and_fraction_of_the_pool(metrics, registry):
    metrics.set_kv_cache_saved(saved_blocks=120, total_blocks=480)
    assert registry.get_sample_value("vllm_kvevict_kv_blocks_saved") == 120
    assert registry.get_sample_value("vllm_kvevict_kv_cache_saved_perc") == 0.25


def test_resident_tokens_gauge_follows_the_last_value(metrics, registry):
    metrics.set_kv_tokens_resident(5000)
    metrics.set_kv_tokens_resident(3000)
    assert registry.get_sample_value("vllm_kvevict_kv_tokens_resident") == 3000


def test_config_info_names_method_budget_and_params(metrics, registry):
    metrics.record_eviction_config("ada-snapkv", 0.25, {"window": 32, "alpha": 0.2})
    labels = {"method": "ada-snapkv", "budget": "0.25", "params": "alpha=0.2,window=32"}
    assert registry.get_sample_value("vllm_kvevict_config_info", labels) == 1


def test_every_series_carries_the_single_prefix(metrics, registry):
    compact_two_requests(metrics)
    metrics.observe_eviction_step(0.01)
    metrics.set_kv_cache_saved(1, 2)
    metrics.set_kv_tokens_resident(1)
    metrics.record_eviction_config("snapkv", 512, {})
    names = {s.name for family in registry.collect() for s in family.samples}
    assert names and all(name.startswith("vllm_kvevict_") for name in names)


def test_kept_per_head_counts_give_layer_budgets_and_head_ratios(monkeypatch, metrics, registry):
    from vllm_kvevict import metrics as module

    monkeypatch.setattr(module, "_process_metrics", metrics)
    module.record_kept_per_head("ada-snapkv", 1000, [[100, 300], [200, 200]], blocks_freed=5)
    assert registry.get_sample_value("vllm_kvevict_tokens_kept_total") == 200
    assert registry.get_sample_value("vllm_kvevict_layer_kept_budget", {"layer": "0"}) == 200
    assert registry.get_sample_value("vllm_kvevict_head_budget_ratio_sum") == pytest.approx(0.5 + 1.5 + 1 + 1)
    assert registry.get_sample_value("vllm_kvevict_head_budget_ratio_bucket", {"le": "0.5"}) == 1


def run_python(code: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_importing_the_module_creates_no_series():
    out = run_python(
        """
        from prometheus_client import REGISTRY, generate_latest
        import vllm_kvevict.metrics
        print(b"vllm_kvevict_" in generate_latest(REGISTRY))
        """,
        dict(os.environ),
    )
    assert out.strip() == "False"


def test_values_recorded_in_another_process_reach_a_multiprocess_registry(tmp_path: Path):
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    run_python(
        """
        from vllm_kvevict import metrics
        metrics.record_request_compacted("ada-snapkv", 4000, 1000.0, [900.0, 1100.0], [0.5, 1.5], 60)
        metrics.observe_eviction_step(0.02)
        metrics.set_worker_requests(3)
        metrics.set_kv_cache_saved(60, 600)
        metrics.record_eviction_config("ada-snapkv", 1000, {"window": 32})
        """,
        env,
    )
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    get = registry.get_sample_value
    assert get("vllm_kvevict_requests_compacted_total", {"method": "ada-snapkv"}) == 1
    assert get("vllm_kvevict_blocks_freed_total") == 60
    assert get("vllm_kvevict_kept_ratio_count") == 1
    assert get("vllm_kvevict_eviction_step_seconds_count", {"phase": "total"}) == 1
    assert get("vllm_kvevict_worker_requests") == 3
    assert get("vllm_kvevict_kv_cache_saved_perc") == 0.1
    assert get("vllm_kvevict_layer_kept_budget", {"layer": "1"}) == 1100
    info = {"method": "ada-snapkv", "budget": "1000", "params": "window=32"}
    assert get("vllm_kvevict_config_info", info) == 1


def test_multiprocess_collection_switched_on_late_covers_this_process_and_its_children():
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    out = run_python(
        """
        import os, subprocess, sys
        from prometheus_client import CollectorRegistry, Counter, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        from vllm_kvevict.vllm_adapter.metrics_multiprocess import ensure_multiprocess_collection

        directory = ensure_multiprocess_collection()
        assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(directory)
        Counter("api_server_requests", "made in the serving process").inc(2)
        child = "from vllm_kvevict import metrics; metrics.record_request_skipped('snapkv')"
        subprocess.run([sys.executable, "-c", child], check=True)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        print(registry.get_sample_value("api_server_requests_total"))
        print(registry.get_sample_value("vllm_kvevict_requests_skipped_total", {"method": "snapkv"}))
        """,
        env,
    )
    assert out.split() == ["2.0", "1.0"]


def test_exposition_text_names_help_and_type(metrics, registry):
    metrics.observe_eviction_step(0.01)
    text = generate_latest(registry).decode()
    assert "# TYPE vllm_kvevict_eviction_step_seconds histogram" in text
    assert "# HELP vllm_kvevict_eviction_step_seconds Time of the eviction work" in text


def test_a_muted_process_records_nothing():
    """Tensor-parallel ranks other than 0 are muted (every rank compacts the same requests)."""
    out = run_python(
        """
        from prometheus_client import REGISTRY
        from vllm_kvevict import metrics
        metrics.mute_this_process()
        metrics.record_request_skipped("snapkv")
        metrics.record_kept_per_head("snapkv", 100, [[10, 10]], 2)
        muted = REGISTRY.get_sample_value("vllm_kvevict_requests_skipped_total", {"method": "snapkv"})
        metrics.mute_this_process(False)
        metrics.record_request_skipped("snapkv")
        print(muted, REGISTRY.get_sample_value("vllm_kvevict_requests_skipped_total", {"method": "snapkv"}))
        """,
        dict(os.environ),
    )
    assert out.strip() == "None 1.0"
