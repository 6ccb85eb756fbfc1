"""``benchmarks/prefix_profile.py``'s parts: the attention-kernel timer it loads into each server
(``benchmarks/attention_timer/sitecustomize.py``: every call passed through unchanged; calls, query rows and
work units counted per batch kind in the file it names) and the table it prints."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import torch

TIMER = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_timer" / "sitecustomize.py"


def load_timer(monkeypatch, times: Path | None, started: list | None = None):
    """The timer module, loaded with ``KVEVICT_ATTENTION_TIMES`` = ``times`` (unset for None); a thread it
    would start goes to ``started`` instead."""
    if times is None:
        monkeypatch.delenv("KVEVICT_ATTENTION_TIMES", raising=False)
    else:
        monkeypatch.setenv("KVEVICT_ATTENTION_TIMES", str(times))
    threads = [] if started is None else started
    monkeypatch.setattr("threading.Thread.start", lambda self: threads.append(self))
    spec = importlib.util.spec_from_file_location("attention_timer_under_test", TIMER)
    module = importlib.util.module_from_spec(spec)
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


def test_without_a_file_named_the_timer_does_nothing(monkeypatch):
    started: list = []
    module = load_timer(monkeypatch, None, started)
    assert module._PATH is None and started == []


def test_the_profile_table_reports_each_batch_kind_and_the_difference(monkeypatch):
    monkeypatch.syspath_prepend(str(TIMER.parents[2]))  # the repository root: ``benchmarks`` is no package
    from benchmarks.prefix_profile import FRAMES, Profile, table
    from benchmarks.prefix_repetition import Run

    def run(server: str, duration_s: float, tok_s: float, computed: float, evicting_s: float) -> Run:
        return Run(server, "3000:400", 16, duration_s, tok_s, 0.7, 12000.0, 150.0, 20000.0, 44000.0, 54000.0,
                   computed, 0.28, 0.0, evicting_s)

    frames = {name: 1.0 for name, _ in FRAMES}
    vanilla = Profile(run("vanilla", 20.0, 50.0, 10240, 0.0), 68,
                      {"9 query heads/seq, decode only": [10, 2.0, 10, 4e8]}, frames, 20.0)
    evicting = Profile(run("ada-snapkv @ 0.25", 25.0, 40.0, 10880, 2.0), 68,
                       {"3 query heads/seq, decode only": [10, 3.0, 30, 6e8]}, frames, 25.0)
    text = table([vanilla, evicting])
    assert "| output tok/s | 50.0 | 40.0 | 0.800x |" in text
    assert "| prompt tokens computed | 10240 | 10880 | +640 |" in text
    assert "| attention kernel, all batches, s | 2.00 | 3.00 | +1.00 |" in text
    assert "|   9 query heads/seq, decode only: ns per work unit | 5.000 | 0.000 | -5.000 |" in text
    assert "|   3 query heads/seq, decode only: s | 0.00 | 3.00 | +3.00 |" in text


def test_a_run_without_py_spy_samples_keeps_its_other_rows(monkeypatch):
    """py-spy can fail to write samples (it panicked when stopped in two runs): the bench results, counters
    and kernel times are still reported, and the missing frames are named."""
    monkeypatch.syspath_prepend(str(TIMER.parents[2]))
    from benchmarks.prefix_profile import FRAMES, Profile, table
    from benchmarks.prefix_repetition import Run

    def run(server: str, tok_s: float) -> Run:
        return Run(server, "3000:400", 16, 20.0, tok_s, 0.7, 12000.0, 150.0, 20000.0, 44000.0, 54000.0,
                   10240.0, 0.28, 0.0, 0.0)

    vanilla = Profile(run("vanilla", 50.0), 68, {}, {name: 1.0 for name, _ in FRAMES}, 20.0)
    evicting = Profile(run("ada-snapkv @ 0.25", 45.0), 68, {}, None, 0.0)
    text = table([vanilla, evicting])
    assert "| output tok/s | 50.0 | 45.0 | 0.900x |" in text
    assert "| py-spy frames | no samples from ada-snapkv @ 0.25 | | |" in text
    assert "worker samples" not in text
