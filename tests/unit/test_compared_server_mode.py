"""bench and eval --compare start every server at vLLM's defaults (compiled) unless --eager, and say so."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvevict import server_process
from vllm_kvevict.cli.main import build_parser
from vllm_kvevict.server_process import (
    COMPILED_STARTUP_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    EAGER_TEXT,
    VLLM_DEFAULTS_TEXT,
)


class LaunchRecorded(Exception):
    """Raised by the fake launcher once it has recorded its arguments."""


@pytest.fixture
def launches(monkeypatch) -> list[dict]:
    """Every VLLMServer(...) the command builds, as its keyword arguments; none is started."""
    recorded: list[dict] = []

    def fake_server(model_dir, **kwargs):
        recorded.append({"model_dir": model_dir, **kwargs})
        raise LaunchRecorded

    monkeypatch.setattr(server_process, "VLLMServer", fake_server)
    return recorded


def bench_args(*extra: str):
    return build_parser().parse_args(["bench", "--model-dir", "/nonexistent", *extra])


@pytest.mark.parametrize("extra, eager", [((), False), (("--eager",), True)])
def test_bench_servers_are_compiled_unless_eager(launches, extra, eager):
    from vllm_kvevict.cli.bench import bench_server, settings_text

    args = bench_args(*extra)
    assert args.eager is eager
    with pytest.raises(LaunchRecorded):
        bench_server(Path("/nonexistent"), "vanilla", ["--max-model-len", "4192"], workload=None, args=args)
    (launch,) = launches
    assert launch["enforce_eager"] is eager
    assert launch["startup_timeout_s"] == (DEFAULT_STARTUP_TIMEOUT_S if eager else COMPILED_STARTUP_TIMEOUT_S)
    assert (EAGER_TEXT if eager else VLLM_DEFAULTS_TEXT) in settings_text(args)


@pytest.mark.parametrize("extra, eager", [((), False), (("--eager",), True)])
def test_eval_compare_servers_are_compiled_unless_eager(launches, tmp_path, extra, eager):
    from vllm_kvevict.evaluation.compare import run_server_config
    from vllm_kvevict.evaluation.configs import EvalConfig

    args = build_parser().parse_args(["eval", "--compare", "--methods", "snapkv", *extra])
    assert args.eager is eager
    with pytest.raises(LaunchRecorded):
        run_server_config(EvalConfig.parse("vllm-vanilla"), [], Path("/nonexistent"), args, tmp_path)
    (launch,) = launches
    assert launch["enforce_eager"] is eager
    assert launch["startup_timeout_s"] == (DEFAULT_STARTUP_TIMEOUT_S if eager else COMPILED_STARTUP_TIMEOUT_S)


def test_the_launcher_alone_stays_eager_by_default(tmp_path):
    """Tests and one-off servers keep --enforce-eager (minutes less per start); only the comparisons that
    users read as "vs vanilla" default to compiled."""
    (tmp_path / "config.json").write_text("{}")
    launcher = server_process.VLLMServer(tmp_path, cpu_setup=False, port=1)
    assert "--enforce-eager" in launcher.command
    compiled = server_process.VLLMServer(tmp_path, cpu_setup=False, port=1, enforce_eager=False)
    assert "--enforce-eager" not in compiled.command


def test_bench_passes_its_eviction_config_to_the_eviction_server_only():
    from vllm_kvevict.cli.bench import server_runs

    args = bench_args("--kv-eviction-config", '{"prefill": "chunked"}')
    (vanilla_label, vanilla), (_, evicting) = server_runs(args)
    assert vanilla_label == "vanilla" and "--kv-eviction-config" not in vanilla
    assert evicting[-2:] == ["--kv-eviction-config", '{"prefill": "chunked"}']


def test_bench_passes_eviction_args_to_the_eviction_server_only():
    from vllm_kvevict.cli.bench import server_runs

    args = bench_args("--eviction-arg=--kv-decode-eviction", "--eviction-arg=kvzap")
    (_, vanilla), (_, evicting) = server_runs(args)
    assert "--kv-decode-eviction" not in vanilla
    assert evicting[-2:] == ["--kv-decode-eviction", "kvzap"]
