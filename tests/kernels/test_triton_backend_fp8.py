"""The GPU backend on an fp8 KV cache (``--kv-cache-dtype fp8``), run by Triton's interpreter on the CPU and
checked against plain torch: vLLM's Triton writer stores e4m3 bytes through the layer's scales, the backend's
cache rows read them back dequantised (``quantised_rows``), ``head_attention`` (``unified_attention`` with one
KV head per (request, head) sequence, ``kv_quant_mode`` passed: without it the kernel reads the bytes
unscaled, 0.64 off here) equals softmax attention over those dequantised rows, and a move copies the bytes.
Float32 queries: the interpreter's bf16 ``unified_attention`` returns garbage on this machine for any cache
dtype. The child process fakes the device capability (sm_90) as ``test_triton_backend_attention.py`` does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

SCRIPT = r"""
import triton, triton.language as tl
import vllm.triton_utils as triton_utils
triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True
import torch
torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
from vllm.platforms import current_platform
current_platform.has_device_capability = lambda *args, **kwargs: True  # fp8 stores need sm_89+
from types import SimpleNamespace
from vllm_kvevict.datapath.moves import Moves
from vllm_kvevict.datapath.step import HeadSequenceBatch
from vllm_kvevict.vllm_adapter.backend_cuda import EvictingTritonAttentionImpl, GPUCacheRows
from vllm_kvevict.vllm_adapter.quantised_rows import DequantisedRows

torch.manual_seed(0)
HEADS, GROUP, D, BS, NB = 2, 3, 32, 16, 12
K_SCALE, V_SCALE = 0.37, 1.7
impl = EvictingTritonAttentionImpl(
    num_heads=HEADS * GROUP, head_size=D, scale=D ** -0.5, num_kv_heads=HEADS, alibi_slopes=None,
    sliding_window=None, kv_cache_dtype="fp8",
)
fp8 = impl.fp8_dtype
layer = SimpleNamespace(_k_scale=torch.tensor(K_SCALE), _v_scale=torch.tensor(V_SCALE))
cache = torch.zeros(NB, HEADS, BS, 2 * D, dtype=torch.uint8)  # vLLM's storage of an fp8 cache
tables = [[9 * HEADS + 0, 2 * HEADS + 0], [6 * HEADS + 1, 0]]  # sub-blocks out of order, ragged lengths
lengths = [21, 7]
keys, values = torch.randn(2, 32, D), torch.randn(2, 32, D)
rows = [(seq, j) for seq in range(2) for j in range(lengths[seq])]
slots = torch.tensor([tables[seq][j // BS] * BS + j % BS for seq, j in rows])
key_rows = torch.stack([keys[seq, j] for seq, j in rows])[:, None]
value_rows = torch.stack([values[seq, j] for seq, j in rows])[:, None]
impl.write_head_tokens(layer, key_rows, value_rows, cache, slots)

cache_rows = impl.cache_rows(layer, cache, key_rows, value_rows)
assert isinstance(cache_rows, DequantisedRows)
raw_keys, raw_values = GPUCacheRows(cache).read(slots)
read_keys, read_values = cache_rows.read(slots)
assert torch.equal(read_keys, raw_keys.view(fp8).float() * K_SCALE)
assert torch.equal(read_values, raw_values.view(fp8).float() * V_SCALE)
# (how close the bytes are to the written rows is the writer's business: the interpreter's float -> e4m3
# cast drops the carry of a mantissa rounded up, e.g. 0.49 -> 0.25, which a GPU's conversion does not)

query = torch.randn(2, GROUP, D)  # one decoding token per sequence
batch = HeadSequenceBatch(
    block_table=torch.tensor(tables, dtype=torch.int32), seq_lens=torch.tensor(lengths, dtype=torch.int32),
    query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), slot_mapping=slots,
)
out = torch.zeros_like(query)
impl.head_attention(layer, SimpleNamespace(max_query_len=1, max_seq_len=21), batch, query, cache, out)
start = 0
for seq in range(2):
    held = slice(start, start + lengths[seq])
    held_keys, held_values = read_keys[held], read_values[held]
    start += lengths[seq]
    weights = (query[seq] @ held_keys.T * D ** -0.5).softmax(-1)
    error = (out[seq] - weights @ held_values).abs().max().item()
    assert error < 1e-4, (seq, error)

free = torch.arange(11 * HEADS * BS, 11 * HEADS * BS + 5)  # sub-block 22 is unused
cache_rows.move(Moves(slots[:5], free))
assert torch.equal(GPUCacheRows(cache).read(free)[0], raw_keys[:5])  # the bytes, not re-quantised
print("triton fp8 head attention ok")
"""


def test_gpu_backend_reads_and_attends_an_fp8_cache_like_the_torch_reference() -> None:
    env = os.environ | {"TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "triton fp8 head attention ok" in result.stdout
