"""The GPU backend's own calls on vLLM's Triton ops, run by Triton's interpreter on the CPU and checked
against a plain-torch reference: ``write_head_tokens`` (``triton_reshape_and_cache_flash`` on the one-head
view) and ``head_attention`` (``unified_attention`` with one KV head per (request, head) sequence, ragged
per-head lengths, sub-blocks out of order, a decoding sequence beside a 5-token causal chunk), and the
cache rows the datapath reads and moves. vLLM disables Triton on a CPU build, so the child process hands
vLLM's Triton utilities the real module and answers the one device-capability query (sm_90)."""

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
from types import SimpleNamespace
from vllm_kvevict.datapath.moves import Moves
from vllm_kvevict.datapath.attention_metadata import HeadSequenceBatch
from vllm_kvevict.vllm_adapter.backend_cuda import EvictingTritonAttentionImpl, GPUCacheRows, one_head_caches

torch.manual_seed(0)
HEADS, GROUP, D, BS, NB = 2, 3, 32, 16, 12
impl = EvictingTritonAttentionImpl(
    num_heads=HEADS * GROUP, head_size=D, scale=D ** -0.5, num_kv_heads=HEADS, alibi_slopes=None,
    sliding_window=None, kv_cache_dtype="auto",
)
layer = SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
cache = torch.zeros(NB, HEADS, BS, 2 * D)
# Sequences (request, head): request 0 decodes 1 token with ragged held lengths 21 and 7 in sub-blocks
# out of order; request 1 prefills a 5-token chunk after 11 cached tokens (standard layout, block 4).
tables = [[9 * HEADS + 0, 2 * HEADS + 0], [6 * HEADS + 1, 0], [4 * HEADS + 0, 0], [4 * HEADS + 1, 0]]
lengths = [21, 7, 16, 16]
q_lens = [1, 1, 5, 5]
def slot(seq, j):
    return tables[seq][j // BS] * BS + j % BS
keys, values = torch.randn(4, 32, D), torch.randn(4, 32, D)
rows = [(seq, j) for seq in range(4) for j in range(lengths[seq])]
slots = torch.tensor([slot(seq, j) for seq, j in rows])
key_rows = torch.stack([keys[seq, j] for seq, j in rows])[:, None]
value_rows = torch.stack([values[seq, j] for seq, j in rows])[:, None]
impl.write_head_tokens(layer, key_rows, value_rows, cache, slots)
key_cache, value_cache = one_head_caches(cache)
assert torch.equal(key_cache[slots // BS, slots % BS, 0], key_rows[:, 0])

query = torch.randn(sum(q_lens), GROUP, D)
starts = torch.tensor([0, 1, 2, 7, 12], dtype=torch.int32)
batch = HeadSequenceBatch(
    block_table=torch.tensor(tables, dtype=torch.int32), seq_lens=torch.tensor(lengths, dtype=torch.int32),
    query_start_loc=starts, slot_mapping=slots,
)
step = SimpleNamespace(max_query_len=5, max_seq_len=21)
out = torch.empty_like(query)
impl.head_attention(layer, step, batch, query, cache, out)
for seq in range(4):
    q = query[starts[seq] : starts[seq + 1]]
    n, m = lengths[seq], q_lens[seq]
    scores = torch.einsum("tgd,sd->gts", q, keys[seq, :n]) * D ** -0.5
    allowed = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    expected = torch.einsum("gts,sd->tgd", weights, values[seq, :n])
    error = (out[starts[seq] : starts[seq + 1]] - expected).abs().max().item()
    assert error < 1e-4, (seq, error)

cache_rows = GPUCacheRows(cache)
read_k, read_v = cache_rows.read(slots[:5])
assert torch.equal(read_k, key_rows[:5, 0]) and torch.equal(read_v, value_rows[:5, 0])
free = torch.arange(11 * HEADS * BS, 11 * HEADS * BS + 5)  # sub-block 22 is unused
cache_rows.move(Moves(slots[:5], free))
assert torch.equal(cache_rows.read_keys(free), key_rows[:5, 0])
print("triton head attention ok")
"""


def test_gpu_backend_writes_and_attends_head_as_sequence_like_the_torch_reference() -> None:
    env = os.environ | {"TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "triton head attention ok" in result.stdout
