"""``VLLMServer.wait_for_metric``: polls ``/metrics`` until a value, or gives up with the last one read."""

from __future__ import annotations

from vllm_kvevict.server_process import VLLMServer


def server_reading(monkeypatch, tmp_path, values: list[float]) -> tuple[VLLMServer, list[str]]:
    (tmp_path / "config.json").write_text("{}")
    server = VLLMServer(tmp_path, cpu_setup=False, port=1)
    reads: list[str] = []
    readings = iter(values)

    def metric_value(name: str) -> float:
        reads.append(name)
        return next(readings, values[-1])

    monkeypatch.setattr(server, "metric_value", metric_value)
    return server, reads


def test_it_reads_until_the_expected_value(monkeypatch, tmp_path):
    server, reads = server_reading(monkeypatch, tmp_path, [0.4, 0.2, 0.0, 0.7])
    assert server.wait_for_metric("vllm:kv_cache_usage_perc", poll_s=0) == 0.0
    assert reads == ["vllm:kv_cache_usage_perc"] * 3


def test_it_returns_the_last_value_when_time_runs_out(monkeypatch, tmp_path):
    server, reads = server_reading(monkeypatch, tmp_path, [0.4, 0.3])
    assert server.wait_for_metric("m", expected=0.0, timeout_s=0.05, poll_s=0.01) == 0.3
    assert len(reads) >= 2
