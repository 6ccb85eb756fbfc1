"""Stands in for vLLM's compiled ``vllm._C_stable_libtorch`` in the GPU bundle (vLLM 0.32.0).

``vllm/platforms/cuda.py`` imports the compiled module unconditionally; the bundle copies this file there.
It registers in ``torch.ops._C`` only the ops vLLM looks up on the bundle's serving path (Llama, V1 model
runner, ``TRITON_ATTN``, custom ops off, native RMSNorm), each with a native torch implementation:

- ``cutlass_scaled_mm_supports_block_fp8``: called while ``quantization/utils/w8a8_utils.py`` is imported
  (every server imports it); a capability query, so False: no CUTLASS here.
- ``silu_and_mul``: bound in ``SiluAndMul.__init__`` even when the layer runs ``forward_native``.
- ``weak_ref_tensor``: ``vllm.utils.torch_utils.weak_ref_tensor``, which CUDA-graph capture calls on each
  graph's outputs. The compiled op returns a non-owning alias; torch has no Python API for one, so this
  returns an owning alias: the same values, the captured outputs kept alive a little longer.

Found by tracing every ``torch.ops._C`` lookup with the CUDA platform mocked on a CPU machine
(``tests/gpu_bundle``); an op the GPU reaches and the CPU could not shows on the GPU as
``AttributeError: '_OpNamespace' '_C' object has no attribute ...``, and the job's summary names it.
"""

import torch
import torch.nn.functional as F

_library = torch.library.Library("_C", "FRAGMENT")


def _silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """out [..., d] = silu(x[..., :d]) * x[..., d:] for x [..., 2d] (vLLM's csrc/activation_kernels.cu)."""
    d = x.shape[-1] // 2
    out.copy_(F.silu(x[..., :d]) * x[..., d:])


def _weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(tensor.shape)


#: schema -> native implementation, for every op this stub registers.
OPS = {
    "cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool": lambda capability: False,
    "silu_and_mul(Tensor! result, Tensor input) -> ()": _silu_and_mul,
    "weak_ref_tensor(Tensor input) -> Tensor": _weak_ref_tensor,
}

for _schema, _implementation in OPS.items():
    _name = _schema.split("(", 1)[0]
    _library.define(_schema)
    _library.impl(_name, _implementation, "CompositeExplicitAutograd")
