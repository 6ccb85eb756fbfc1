"""bench and eval --compare pass ``--kv-cache-dtype`` to every server they start, vanilla included (an fp8
vanilla is the baseline of fp8 with eviction), and nothing with the default ``auto``. No server starts: the
launcher is replaced by one that records its arguments, and the real launcher's command line is built from
them."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvevict import server_process
from vllm_kvevict.cli.main import build_parser

REAL_SERVER = server_process.VLLMServer


class LaunchRecorded(Exception):
    """Raised by the fake launcher once it has recorded its arguments."""


@pytest.fixture
def launches(monkeypatch) -> list[dict]:
    """Every VLLMServer(...) the command builds, as its keyword arguments; none is started."""
    recorded: list[dict] = []

    def fake_server(model_dir, **kwargs):
        recorded.append(kwargs)
        raise LaunchRecorded

    monkeypatch.setattr(server_process, "VLLMServer", fake_server)
    return recorded


def command_line(tmp_path: Path, launch: dict) -> list[str]:
    """The ``vllm serve`` command the real launcher builds from the recorded arguments."""
    (tmp_path / "config.json").write_text("{}")
    kwargs = {k: v for k, v in launch.items() if k in ("extra_args", "enforce_eager")}
    return REAL_SERVER(tmp_path, cpu_setup=False, port=1, **kwargs).command


def dtype_of(command: list[str]) -> str | None:
    return command[command.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in command else None


@pytest.mark.parametrize("extra, expected", [((), None), (("--kv-cache-dtype", "fp8"), "fp8")])
def test_bench_gives_both_servers_the_cache_dtype(launches, tmp_path, extra, expected):
    from vllm_kvevict.cli.bench import bench_server, server_runs, settings_text

    args = build_parser().parse_args(["bench", "--model-dir", "/nonexistent", *extra])
    for label, server_extra in server_runs(args):
        with pytest.raises(LaunchRecorded):
            bench_server(Path("/nonexistent"), label, server_extra, workload=None, args=args)
    assert [dtype_of(command_line(tmp_path, launch)) for launch in launches] == [expected, expected]
    assert ("--kv-cache-dtype fp8" in settings_text(args)) is (expected == "fp8")


@pytest.mark.parametrize("extra, expected", [((), None), (("--kv-cache-dtype", "fp8"), "fp8")])
def test_eval_compare_gives_every_server_the_cache_dtype(launches, tmp_path, extra, expected):
    from vllm_kvevict.evaluation.compare import run_server_config, server_configs

    args = build_parser().parse_args(
        ["eval", "--compare", "--methods", "ada-snapkv", "--budgets", "0.25,0.1", *extra]
    )
    configs = server_configs(args.methods, args.budgets)
    for config in configs:
        with pytest.raises(LaunchRecorded):
            run_server_config(config, [], Path("/nonexistent"), args, tmp_path)
    commands = [command_line(tmp_path, launch) for launch in launches]
    assert [dtype_of(command) for command in commands] == [expected] * len(configs) == [expected] * 3
    assert "--kv-eviction" not in commands[0] and "--kv-eviction" in commands[1]


def test_bench_measures_through_vllm_bench_serve_when_asked(launches):
    from vllm_kvevict.cli.bench import settings_text

    args = build_parser().parse_args(["bench", "--client", "vllm"])
    assert args.client == "vllm" and "`vllm bench serve`, random prompts" in settings_text(args)
    assert build_parser().parse_args(["bench"]).client == "openai"
