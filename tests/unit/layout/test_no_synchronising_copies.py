"""The decode datapath copies host values to the cache's device without synchronising.

``torch.tensor(values, device=cuda)`` copies from pageable memory and blocks the host until the GPU has
caught up; on the H100 run of 2026-11-27 (``benchmarks/host_overhead.py --device cuda --sync-debug warn``)
that was the only synchronisation in a decode step, at every batch membership change. The datapath uses
``batch_tables.host_to_device`` (pinned, non-blocking) instead; this keeps the pattern from coming back.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_kvevict.layout.batch_tables import host_to_device

PACKAGE = Path(__file__).resolve().parents[3] / "vllm_kvevict"
DATAPATH = [
    "layout/batch_tables.py",
    "layout/subblock_store.py",
    "layout/subblock_ids.py",
    "layout/table_growth.py",
    "layout/head_mirror.py",
    *sorted(str(path.relative_to(PACKAGE)) for path in (PACKAGE / "datapath").glob("*.py")),
    "vllm_adapter/backend_cuda.py",
]
HOST_LIST_TO_DEVICE = re.compile(r"torch\.(?:tensor|as_tensor)\([^()]*(?:\([^()]*\)[^()]*)*device=")


@pytest.mark.parametrize("module", DATAPATH)
def test_datapath_module_builds_no_device_tensor_from_host_values(module):
    source = (PACKAGE / module).read_text()
    found = [m.group(0) for m in HOST_LIST_TO_DEVICE.finditer(source)]
    assert not found, f"{module}: {found} copies synchronously on CUDA; use batch_tables.host_to_device"


def test_the_pattern_is_recognised():
    assert HOST_LIST_TO_DEVICE.search("x = torch.tensor(leaving, device=store.device)")
    assert HOST_LIST_TO_DEVICE.search("torch.as_tensor(np.array(rows), dtype=torch.int64, device=d)")
    assert not HOST_LIST_TO_DEVICE.search("torch.zeros(3, device=d)")


def test_host_to_device_gives_int64_values_in_order():
    got = host_to_device(np.array([3, 1, 2], dtype=np.int32), torch.device("cpu"))
    assert got.dtype == torch.int64 and got.tolist() == [3, 1, 2]
