"""The key-range split choice of the ragged attention kernel (a host function: no GPU needed).

The expected counts are the H100 sweep's fastest or nearest to it (2026-11-27,
docs/history/2026-11-27-benchmarks-h100-kernels-and-datapath.md)."""

from __future__ import annotations

import pytest

from vllm_kvevict.triton_kernels.paged_attention import MAX_SPLITS, split_count

H100_SMS = 132


@pytest.mark.parametrize(
    ("batch", "longest", "expected"),
    [
        (64, 19597, 1),  # 512 programs fill the GPU; measured 0.89-1.06 of flash SDPA unsplit
        (33, 5000, 1),
        (16, 4901, 5),  # fastest measured: 4 (0.90 of flash SDPA; choose_num_splits' old 3 gave 0.85)
        (4, 45127, 17),  # fastest measured: 16 (0.93; old 9 gave 0.70)
        (1, 19609, MAX_SPLITS),  # fastest measured: 32
        (1, 580, 5),  # fastest measured: 8 (0.84; the old rule did not split below 1024 keys: 0.55)
    ],
)
def test_split_count_follows_the_h100_sweep(batch, longest, expected):
    assert split_count(batch * 8, longest, H100_SMS) == expected


def test_short_sequences_are_not_split_below_the_minimum_keys():
    assert split_count(8, 100, H100_SMS) == 1
    assert split_count(8, 129, H100_SMS) == 2


def test_split_count_never_drops_below_one_or_exceeds_the_cap():
    for programs in (1, 7, 100, 263, 264, 10_000):
        for longest in (0, 1, 64, 10**6):
            assert 1 <= split_count(programs, longest, H100_SMS) <= MAX_SPLITS
