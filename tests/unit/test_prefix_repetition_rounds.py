"""``benchmarks/prefix_repetition.py --rounds``: each round's ratio is taken against that round's vanilla run,
whichever server ran first in it, and the summary gives their median and range."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository root: ``benchmarks`` is no package


def run(server: str, round_: int, duration_s: float, tok_s: float):
    from benchmarks.prefix_repetition import Run

    return Run(server, "3000:400", 16, duration_s, tok_s, 0.7, 9000.0, 140.0, 18000.0, 44000.0, 54000.0,
               10240.0, 0.28, 0.0, 0.0, round_)


def test_each_round_is_compared_with_its_own_vanilla_run(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.prefix_repetition import by_server, ratio_summary, table

    evicting = "ada-snapkv @ 0.25"
    runs = [
        run("vanilla", 0, 16.0, 60.0), run(evicting, 0, 20.0, 48.0),  # 0.80
        run(evicting, 1, 25.0, 40.0), run("vanilla", 1, 25.0, 40.0),  # eviction first: 1.00
        run("vanilla", 2, 18.0, 50.0), run(evicting, 2, 20.0, 45.0),  # 0.90
    ]
    second = by_server(r for r in runs if r.round == 1)
    assert [r.server for r in second] == ["vanilla", evicting]
    assert f"| {evicting} | 16 | 40.0 (1.00x)" in table(second)
    summary = ratio_summary(runs, "3000:400")
    assert "over 3 rounds: median 0.90x, min 0.80x, max 1.00x" in summary
    assert "per round 0.80, 1.00, 0.90" in summary
    assert "vanilla/eviction s 16.0/20.0, 25.0/25.0, 18.0/20.0" in summary


def test_pinned_servers_get_disjoint_cpu_halves_and_serve_a_round_together(monkeypatch):
    """``--pinned``: each engine bound to its own share of the CPUs, and a round's two ``vllm bench serve``
    runs overlap (each waits at a barrier the other must reach: one after the other, they would time out)."""
    import threading

    monkeypatch.syspath_prepend(str(ROOT))
    import benchmarks.prefix_repetition as bench

    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    assert bench.cpu_shares(2) == ["0,1", "2,3"]
    assert bench.cpu_shares(3) == ["0", "1", "2"]
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(SystemExit, match="at least 3 CPUs for 3 servers"):
        bench.cpu_shares(3)

    both_running = threading.Barrier(2, timeout=10)

    def fake_bench(server, label, prefix, suffix, args, index):
        both_running.wait()
        return run(label, index, 20.0, 50.0)

    monkeypatch.setattr(bench, "bench_workload", fake_bench)
    runs = bench.together([("vanilla", object()), ("ada-snapkv @ 0.25", object())], 3000, 400, None, 4)
    assert [(r.server, r.round) for r in runs] == [("vanilla", 4), ("ada-snapkv @ 0.25", 4)]


def test_a_twin_vanilla_server_gets_its_own_ratio_line_and_the_order_rotates(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.prefix_repetition import ratio_summary, rotated

    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert rotated(["vanilla", "eviction"], 1) == ["eviction", "vanilla"]
    evicting = "ada-snapkv @ 0.25"
    runs = [
        run("vanilla", 0, 16.0, 50.0), run("vanilla twin", 0, 16.0, 45.0), run(evicting, 0, 20.0, 40.0),
        run(evicting, 1, 20.0, 60.0), run("vanilla", 1, 16.0, 50.0), run("vanilla twin", 1, 16.0, 55.0),
    ]
    twin, evicted = ratio_summary(runs, "3000:400").splitlines()
    assert twin.startswith("workload 3000:400 (vanilla twin): output tok/s ratio over 2 rounds: median 1.00x")
    assert "per round 0.90, 1.10" in twin
    assert evicted.startswith(f"workload 3000:400 ({evicting}): output tok/s ratio over 2 rounds: median 1")
    assert "per round 0.80, 1.20" in evicted
