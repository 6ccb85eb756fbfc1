"""`benchmarks/threshold_served.py`: the kept share per task, from the compacted prompts' debug dumps."""

from __future__ import annotations

import os

import torch


def test_kept_share_pairs_each_dump_with_its_prompt_in_order_and_summarises_per_task(tmp_path) -> None:
    from benchmarks.threshold_served import kept_share

    rows = [
        {"task": "a", "sample_id": "a-0", "served_prompt_tokens": 100},
        {"task": "b", "sample_id": "b-0", "served_prompt_tokens": 200},
        {"task": "a", "sample_id": "a-1", "served_prompt_tokens": 100},
    ]
    kept = [[10, 30], [20, 20], [50, 50]]  # per layer: counts of two heads, for each prompt in order
    for index, (row, counts) in enumerate(zip(rows, kept, strict=True)):
        path = tmp_path / f"req-{9 - index}.pt"  # names in the opposite order: the write order decides
        record = {"prompt_len": row["served_prompt_tokens"], "counts": [torch.tensor(counts)] * 2}
        torch.save(record, path)
        os.utime(path, ns=(index * 10**9, index * 10**9))
    shares = kept_share(tmp_path, rows)
    assert shares == {"a": [0.2, 0.35, 0.5], "b": [0.1, 0.1, 0.1]}
    assert kept_share(tmp_path, rows[:2]) == {}  # a prompt without its dump: no pairing is trusted
