"""Every script in ``examples/`` run as a user runs it, against one real server.

One server (``--kv-eviction ada-snapkv --kv-budget 0.25 --block-size 32``: the default method, prefix caching
on as vLLM leaves it); each example runs once as a subprocess of this interpreter with ``--base-url`` (the
order matters only for ``read_metrics.py``, run last so that the counters it prints have moved). The checks
read the scripts' own output, and compare what they report from ``/metrics`` with the server's.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: run in this order; read_metrics.py last
ORDER = ("streaming_chat.py", "per_request_settings.py", "kept_context.py", "read_metrics.py")
SERVER_ARGS = (
    "--kv-eviction", "ada-snapkv",
    "--kv-budget", "0.25",
    "--block-size", "32",
    "--max-model-len", "2048",
)  # fmt: skip
COMPACTED = "vllm_kvevict_requests_compacted_total"


def test_every_example_is_run_here():
    assert sorted(path.name for path in EXAMPLES.glob("*.py")) == sorted(ORDER)


@pytest.fixture(scope="module")
def run(model_dir):
    """{example file: its stdout}, plus the server's own counters read after the last one."""
    outputs: dict[str, str] = {}
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, kv_cache_space_gib=1) as server:
        for name in ORDER:
            result = subprocess.run(
                [sys.executable, str(EXAMPLES / name), "--base-url", server.base_url],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
            outputs[name] = result.stdout
        compacted = {labels["method"]: value for labels, value in server.metric_samples(COMPACTED)}
    return outputs, compacted



def test_streaming_chat_streams_pieces_until_its_token_limit(run):
    outputs, _ = run
    found = re.search(r"\[(\d+) streamed pieces, finish_reason=(\w+)\]", outputs["streaming_chat.py"])
    assert found, outputs["streaming_chat.py"]
    assert int(found.group(1)) >= 2
    assert found.group(2) in ("length", "stop")


def test_per_request_settings_are_served_refused_and_counted_by_method(run):
    outputs, _ = run
    text = outputs["per_request_settings.py"]
    for label in ("server's setting", "snapkv at 10 %", "kept whole"):
        assert re.search(rf"^{label}: (['\"]).+\1 \((\d+) prompt tokens\)$", text, re.M), text
    assert (
        "refused with HTTP 400: vllm_xargs.kv_budget='lots' is a string, not a number; valid: an integer >= 1"
        in text
    )
    counts = {
        kind: ast.literal_eval(by_method)
        for kind, by_method in re.findall(r"^requests (\w+) so far, by method: (\{.*\})$", text, re.M)
    }
    assert counts["compacted"].get("ada-snapkv", 0) >= 1  # the server's setting
    assert counts["compacted"].get("snapkv", 0) >= 1  # the request's own method
    assert counts["skipped"].get("none", 0) >= 1  # kept whole


def test_kept_context_is_kept_by_the_default_and_read_by_both_questions(run):
    outputs, _ = run
    text = outputs["kept_context.py"]
    assert (
        "pyramidkv cannot keep a context, HTTP 400: vllm_xargs.kv_context='keep' with "
        "kv_eviction='pyramidkv': a kept context needs a method whose heads keep whole blocks" in text
    )
    assert len(re.findall(r"^Q: .+ A: Shelf \d+ holds (['\"]).+\1$", text, re.M)) == 2, text
    found = re.search(r"(\d+)-token document, the server method at 0.25: contexts kept (\d+), read (\d+)",
                      text)
    assert found, text
    assert int(found.group(1)) > 256  # 25 % of it is more than the window of 32: a compacted context
    assert (int(found.group(2)), int(found.group(3))) == (1, 2)  # one creator, two readers


def test_read_metrics_prints_the_setting_and_the_servers_counters(run):
    outputs, compacted = run
    text = outputs["read_metrics.py"]
    assert "setting: method=ada-snapkv budget=0.25" in text
    assert re.search(r"^gauge vllm_kvevict_kv_cache_saved_perc\{\} = ", text, re.M), text
    printed = {
        method: float(value)
        for method, value in re.findall(rf"^counter {COMPACTED}\{{method=([\w-]+)\}} = (\S+)$", text, re.M)
    }
    assert printed == compacted
    assert printed["ada-snapkv"] >= 1
