"""The benchmark's attention-kernel timer (``benchmarks/attention_timer/sitecustomize.py``): it passes every
call through unchanged and counts calls, query rows and work units per batch kind, in the file it names."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import torch

TIMER = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_timer" / "sitecustomize.py"


def load_timer(monkeypatch, times: Path):
    monkeypatch.setenv("KVEVICT_ATTENTION_TIMES", str(times))
    spec = importlib.util.spec_from_file_location("attention_timer_under_test", TIMER)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr("threading.Thread.start", lambda self: None)  # no polling thread in the test
    spec.loader.exec_module(module)
    return module


def test_the_timer_passes_calls_through_and_counts_rows_and_work_per_batch_kind(monkeypatch, tmp_path):
    times = tmp_path / "times.json"
    timer = load_timer(monkeypatch, times)
    calls = []
    ops = types.SimpleNamespace(cpu_attention_with_kv_cache=lambda **kwargs: calls.append(kwargs) or "out")
    timer._install(ops)

    def call(rows_per_seq: list[int], lengths: list[int], heads: int):
        starts = torch.tensor([0, *torch.tensor(rows_per_seq).cumsum(0).tolist()], dtype=torch.int32)
        query = torch.zeros(sum(rows_per_seq), heads, 4)
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        return ops.cpu_attention_with_kv_cache(query=query, query_start_loc=starts, seq_lens=seq_lens)

    assert call([1, 1], [10, 20], heads=9) == "out"
    assert call([5, 1], [5, 30], heads=3) == "out"
    assert call([1], [7], heads=9) == "out"
    assert len(calls) == 3
    totals = json.loads(times.read_text())
    decode = totals["9 query heads/seq, decode only"]
    assert decode[0] == 2 and decode[2] == 3 and decode[3] == (10 + 20 + 7) * 9
    prefill = totals["3 query heads/seq, with prefill"]
    assert prefill[0] == 1 and prefill[2] == 6 and prefill[3] == (5 * 5 + 1 * 30) * 3
    assert decode[1] >= 0.0 and prefill[1] >= 0.0


def test_without_a_file_named_the_timer_does_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv("KVEVICT_ATTENTION_TIMES", raising=False)
    started = []
    monkeypatch.setattr("threading.Thread.start", lambda self: started.append(self))
    spec = importlib.util.spec_from_file_location("attention_timer_off", TIMER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._PATH is None and started == []
