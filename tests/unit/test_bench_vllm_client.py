"""``vllm-kvevict bench --client vllm``: the ``vllm bench serve`` command vLLM's own parser reads as the
workload's shape, and its detailed result read as per-request timings. No server starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvevict.bench.metrics_poller import Peaks
from vllm_kvevict.bench.report import summarise
from vllm_kvevict.bench.vllm_client import bench_serve_command, timing_from_result


def parsed(command: list[str]):
    """``command``'s flags as vLLM's own bench parser reads them (vllm/benchmarks/serve.py)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(command[command.index("serve") + 1 :])


def test_the_command_is_random_prompts_of_the_workloads_shape_all_at_once(tmp_path):
    result = tmp_path / "r.json"
    command = bench_serve_command("http://127.0.0.1:8000", "bundled", tmp_path, 32, 4000, 128, 0, result)
    assert command[1:3] == ["bench", "serve"]
    args = parsed(command)
    assert (args.dataset_name, args.random_input_len, args.random_output_len) == ("random", 4000, 128)
    assert (args.num_prompts, args.request_rate, args.ignore_eos, args.max_concurrency) == (
        32,
        float("inf"),
        True,
        None,
    )
    assert args.save_detailed and Path(args.result_dir) / args.result_filename == result
    assert (
        parsed(bench_serve_command("u", "m", tmp_path, 4, 8, 2, 0, result, concurrency=3)).max_concurrency
        == 3
    )


def detailed(errors: list[str]) -> dict:
    """The keys of a ``--save-detailed`` result the bench reads, two requests."""
    return {
        "duration": 10.0,
        "failed": sum(1 for e in errors if e),
        "ttfts": [1.0, 3.0],
        "latencies": [5.0, 9.0],
        "output_lens": [128, 128],
        "input_lens": [4000, 4000],
        "errors": errors,
    }


def test_a_detailed_result_becomes_the_reports_timings():
    timing = timing_from_result(detailed(["", ""]))
    row = summarise("vanilla", timing, Peaks(max_running=2))
    assert (row.output_tok_s, row.ttft_p50_s, row.latency_mean_s, row.num_requests) == (25.6, 2.0, 7.0, 2)
    assert row.prompt_tok_s == pytest.approx(8000 / 3.0)


def test_a_failed_request_is_no_measurement():
    with pytest.raises(RuntimeError, match="1 requests failed"):
        timing_from_result(detailed(["", "Bad Request"]))
