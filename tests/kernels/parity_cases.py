"""Every fast backend (Triton, CUDA) against the torch reference on the same inputs.

Not collected by the default run (the name does not start with ``test_``): Triton needs a GPU or its
interpreter, and the interpreter must be switched on before triton is imported. ``test_dispatch.py`` runs
this file in a subprocess with ``TRITON_INTERPRET=1``; on a GPU machine
``benchmarks/kernels/run_gpu_tests.sh`` runs it directly on CUDA (CUDA op included, half precision added).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import BLOCK_SIZE, compaction_plan, paged_sequences, query_start_loc

from vllm_kvevict.layout.kernels import dispatch, reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FAST_BACKENDS = [b for b in ("cuda", "triton") if dispatch.unavailable_reason(b, DEVICE) is None]
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# scores are probabilities (<= 1) from logits of half-precision keys: float32 math, half inputs
SCORE_TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-4}
# vLLM's CUDA default (16), the CPU build's (32), and a large block (128); one sub-block per (block, head).
# Under the CPU interpreter (slow) the two ends only.
BLOCK_SIZES = [16, 32, 128] if DEVICE.type == "cuda" else [16, 128]


def test_this_machine_runs_triton():
    """The run exists to check Triton: without it (no GPU, no interpreter) it must fail, not pass empty."""
    assert "triton" in FAST_BACKENDS, dispatch.unavailable_reason("triton", DEVICE)


def test_the_cuda_op_is_available_exactly_on_a_gpu():
    """On a GPU the CUDA op must build (nvcc + ninja): a silent fallback would leave it untested."""
    reason = dispatch.unavailable_reason("cuda", DEVICE)
    if DEVICE.type == "cuda":
        assert reason is None, reason
    else:
        assert reason is not None and "needs a CUDA device" in reason


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize(("planes", "head_size"), [(None, 64), (2, 32), (2, 24)])
def test_compaction_matches_reference(backend, dtype, planes, head_size, block_size):
    shape = (12, block_size, head_size) if planes is None else (planes, 12, block_size, head_size)
    caches = [torch.randn(shape).to(dtype).to(DEVICE) for _ in range(3)]
    expected = [c.clone() for c in caches]
    # each run of sub-blocks (one request's head) keeps a random share of its rows: ragged per-head counts
    src, dst, layer = (
        t.to(DEVICE) for t in compaction_plan(3, 12, block_size, kept_fraction=0.3, seed=head_size)
    )
    reference.compact_subblocks(expected, src, dst, layer)
    assert dispatch.compact_subblocks(caches, src, dst, layer, backend=backend) == backend
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("planes", [None, 2])
def test_compaction_moves_the_bytes_of_an_fp8_cache_as_they_are(backend, planes):
    """An fp8 KV cache (vLLM's uint8 storage, or viewed as its fp8 format) is compacted byte for byte: kept
    entries are never re-quantised (issue 51)."""
    shape = (12, 32, 64) if planes is None else (planes, 12, 32, 64)
    generator = torch.Generator().manual_seed(7)
    caches = [
        torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).to(DEVICE) for _ in range(3)
    ]
    expected = [c.clone() for c in caches]
    src, dst, layer = (t.to(DEVICE) for t in compaction_plan(3, 12, 32, kept_fraction=0.3, seed=11))
    reference.compact_subblocks(expected, src, dst, layer)
    assert dispatch.compact_subblocks(caches, src, dst, layer, backend=backend) == backend
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)
    as_fp8 = [c.view(torch.float8_e4m3fn) for c in caches]  # the Triton backend's typed view
    dispatch.compact_subblocks(as_fp8, src, dst, layer, backend=backend)
    reference.compact_subblocks(expected, src, dst, layer)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_compaction_of_a_strided_key_view_leaves_values_alone(backend):
    # one [num_blocks, H, bs, 2D] layer whose K half is moved through a strided [S, bs, D] view
    layer = torch.randn(3, 2, BLOCK_SIZE, 64, device=DEVICE)
    k_view = layer.view(6, BLOCK_SIZE, 64)[..., :32]
    expected = layer.clone()
    src, dst = torch.tensor([5, 40, 77, 3], device=DEVICE), torch.tensor([0, 1, 2, 5], device=DEVICE)
    reference.compact_subblocks(expected.view(6, BLOCK_SIZE, 64)[..., :32], src, dst)
    dispatch.compact_subblocks(k_view, src, dst, backend=backend)
    assert torch.equal(layer, expected)


def test_compaction_with_no_moves_changes_nothing():
    cache = torch.randn(4, BLOCK_SIZE, 32, device=DEVICE)
    before = cache.clone()
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    dispatch.compact_subblocks(cache, empty, empty, backend="triton")
    assert torch.equal(cache, before)


ATTENTION_CASES = [
    # (seq_lens, query_lens, causal): decode incl. length 1 and sub-block boundaries, prefill chunks,
    # length 0; each sequence is one (request, KV head), so the lengths are ragged per-head counts
    ([1, 15, 16, 17, 40, 70], [1, 1, 1, 1, 1, 1], True),
    ([31, 32, 33, 127, 128, 129, 300], [1, 1, 1, 1, 1, 1, 1], True),
    ([5, 33, 20, 64], [5, 7, 1, 16], True),
    ([0, 3, 18], [0, 2, 4], False),
    ([0, 9], [1, 1], False),
]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(("seq_lens", "query_lens", "causal"), ATTENTION_CASES)
def test_ragged_attention_matches_reference(dtype, group, seq_lens, query_lens, causal, block_size):
    case = paged_sequences(
        seq_lens, head_size=64, block_size=block_size, dtype=dtype, device=DEVICE, seed=group
    )
    query = torch.randn(sum(query_lens), group, 64).to(dtype).to(DEVICE)
    starts = query_start_loc(query_lens, DEVICE)
    args = (query, case.k_cache, case.v_cache, case.subblock_tables, case.seq_lens, starts)
    want = reference.ragged_paged_attention(*args, causal=causal)
    got = dispatch.ragged_paged_attention(*args, causal=causal, backend="triton")
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [2, 3, 32])  # 32: most splits hold no key of a short sequence
def test_ragged_attention_split_over_key_ranges_matches_reference(num_splits):
    from vllm_kvevict.triton_kernels.paged_attention import ragged_paged_attention as triton_attention

    seq_lens, query_lens = [70, 1, 33], [1, 1, 4]
    case = paged_sequences(seq_lens, head_size=32, device=DEVICE, seed=num_splits)
    query = torch.randn(sum(query_lens), 3, 32, device=DEVICE)
    starts = query_start_loc(query_lens, DEVICE)
    args = (query, case.k_cache, case.v_cache, case.subblock_tables, case.seq_lens, starts)
    got = triton_attention(*args, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(got, reference.ragged_paged_attention(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(("pool_kernel", "pool_kind"), [(7, "max"), (5, "avg"), (1, "max")])
@pytest.mark.parametrize("window", [1, 8])
def test_window_scores_match_reference(group, pool_kernel, pool_kind, window):
    seq_lens = [8, 17, 33, 70]
    case = paged_sequences(seq_lens, head_size=64, device=DEVICE, seed=window)
    queries = torch.randn(len(seq_lens), group, window, 64, device=DEVICE)
    num_pooled = case.seq_lens - window
    args = (queries, case.k_cache, case.subblock_tables, case.seq_lens)
    kwargs = dict(num_pooled=num_pooled, pool_kernel=pool_kernel, pool_kind=pool_kind)
    want = reference.paged_window_scores(*args, **kwargs)
    got = dispatch.paged_window_scores(*args, **kwargs, backend="triton")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_scores_match_reference_per_dtype_and_block_size(dtype, block_size):
    seq_lens = [9, 31, 32, 33, 129, 300]  # ragged per-head lengths across sub-block boundaries
    case = paged_sequences(seq_lens, head_size=64, block_size=block_size, dtype=dtype, device=DEVICE, seed=3)
    queries = torch.randn(len(seq_lens), 3, 8, 64).to(dtype).to(DEVICE)
    args = (queries, case.k_cache, case.subblock_tables, case.seq_lens)
    kwargs = dict(num_pooled=case.seq_lens - 8, pool_kernel=7, pool_kind="max")
    want = reference.paged_window_scores(*args, **kwargs)
    got = dispatch.paged_window_scores(*args, **kwargs, backend="triton")
    tol = SCORE_TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=1e-2 if dtype != torch.float32 else 1e-4)


def test_window_scores_split_over_key_ranges_and_explicit_positions_match_reference():
    from vllm_kvevict.triton_kernels.window_scores import paged_window_scores as triton_scores

    seq_lens, window = [40, 70], 4
    case = paged_sequences(seq_lens, head_size=32, device=DEVICE, seed=7)
    queries = torch.randn(2, 3, window, 32, device=DEVICE)
    positions = torch.tensor([[10, 20, 30, 39], [0, 16, 17, 69]], device=DEVICE)
    args = (queries, case.k_cache, case.subblock_tables, case.seq_lens, positions)
    got = triton_scores(*args, num_splits=3)
    torch.testing.assert_close(got, reference.paged_window_scores(*args), atol=1e-6, rtol=1e-4)
