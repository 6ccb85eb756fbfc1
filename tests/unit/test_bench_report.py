"""vllm-kvevict bench: statistics, the ratio table, the markdown append, /metrics parsing, the workload."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvevict.bench.client import CLIENT_TIMEOUT, RequestTiming, RunTiming
from vllm_kvevict.bench.metrics_poller import KV_USAGE, RUNNING, Peaks, gauge_values
from vllm_kvevict.bench.report import (
    CAPACITY_HEADING,
    append_to_benchmarks,
    percentile,
    ratio_table,
    summarise,
)


def timing(ttfts: list[float], wall_s: float, tokens: int = 128) -> RunTiming:
    return RunTiming([RequestTiming(ttft_s=t, latency_s=t + 10, output_tokens=tokens) for t in ttfts], wall_s)


def test_a_request_may_wait_in_the_queue_as_long_as_the_run_takes():
    """A 64-prompt run on two CPU cores queued its last requests for over an hour: a read limit of 3600 s
    ended the whole bench with APITimeoutError. Only connecting is limited."""
    assert CLIENT_TIMEOUT.read is None and CLIENT_TIMEOUT.pool is None
    assert CLIENT_TIMEOUT.connect is not None and CLIENT_TIMEOUT.connect <= 120


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it():
    assert RequestTiming(ttft_s=2.0, latency_s=12.0, output_tokens=101).tpot_ms == 100.0


def test_summary_divides_all_output_tokens_by_wall_time():
    result = summarise("vanilla", timing([1.0, 2.0, 3.0, 4.0], wall_s=64.0), Peaks(max_running=4))
    assert result.output_tok_s == 4 * 128 / 64
    assert result.ttft_p50_s == 2.5
    assert result.max_running == 4


def test_ratio_table_compares_every_row_with_the_first():
    vanilla = summarise("vanilla", timing([2.0, 2.0], wall_s=100.0), Peaks(max_running=4, max_kv_usage=1.0))
    evict = summarise("ada-snapkv @ 0.25", timing([1.0, 1.0], wall_s=40.0), Peaks(max_running=15))
    table = ratio_table([vanilla, evict]).splitlines()
    assert table[2].startswith("| vanilla | 4 | 1.00 | 2.6 | 1.00 | 2.00 | 1.00 |")
    assert table[3].startswith("| ada-snapkv @ 0.25 | 15 | 3.75 | 6.4 | 2.50 | 1.00 | 0.50 |")


def test_append_adds_runs_under_the_capacity_heading_and_keeps_other_sections(tmp_path: Path):
    path = tmp_path / "benchmarks.md"
    path.write_text(f"# Benchmarks\n\n{CAPACITY_HEADING}\n\nintro\n\n## GPU kernels\n\nkernel table\n")
    append_to_benchmarks(path, "### Run 1\n")
    append_to_benchmarks(path, "### Run 2\n")
    text = path.read_text()
    positions = [text.index(part) for part in ("intro", "### Run 1", "### Run 2", "## GPU kernels")]
    assert positions == sorted(positions)
    assert text.endswith("## GPU kernels\n\nkernel table\n")


def test_append_creates_the_heading_when_missing(tmp_path: Path):
    path = tmp_path / "benchmarks.md"
    append_to_benchmarks(path, "### Run 1\n")
    assert path.read_text() == f"# Benchmarks\n\n{CAPACITY_HEADING}\n\n### Run 1\n"


def test_gauge_values_sum_over_label_sets():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    )
    assert gauge_values(text, (RUNNING, KV_USAGE)) == {RUNNING: 5.0, KV_USAGE: 0.5}


@pytest.mark.model
def test_workload_prompts_have_the_exact_length_and_no_shared_first_block(model_dir: Path):
    from vllm_kvevict.bench.workload import build_workload

    workload = build_workload(model_dir, num_prompts=4, prompt_tokens=500, output_tokens=8, seed=3)
    assert [len(prompt) for prompt in workload.prompts] == [500] * 4
    assert len({tuple(prompt[:16]) for prompt in workload.prompts}) == 4
    assert build_workload(model_dir, 4, 500, 8, seed=3).prompts == workload.prompts


def test_poller_keeps_the_peak_kv_usage_of_decode_only_polls():
    from vllm_kvevict.bench.metrics_poller import GENERATION_TOKENS, PROMPT_TOKENS, MetricsPoller

    poller = MetricsPoller("http://127.0.0.1:1/metrics")
    polls = [  # (prompt tokens, generated tokens, usage)
        (0, 0, 0.0),
        (512, 0, 0.30),  # a prompt admitted: not a decode poll
        (1024, 1, 0.35),
        (1024, 9, 0.10),  # decoding only
        (1024, 17, 0.12),
    ]
    for prompt, generated, usage in polls:
        poller._count_tokens({PROMPT_TOKENS: prompt, GENERATION_TOKENS: generated, KV_USAGE: usage})
    assert poller.peaks.max_kv_usage_decoding == 0.12
