"""The GPU job's ``vllm serve`` command lines: vanilla (vLLM's Triton attention) and eviction (ours).

Every server runs the path the bundle supports without vLLM's compiled extension
(``../shared/gpu-vllm-bundle/README.md``): the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``; V2 calls
``_C.get_cuda_view_from_cpu_tensor``), custom ops off (native rotary and SiluAndMul), native RMSNorm through
vLLM's IR dispatch, eager mode unless a stage asks for piecewise CUDA graphs, and dummy weights (only the
config and tokenizer travel). Vanilla attends with ``TRITON_ATTN``; eviction with ``CUSTOM``, the project's
backend built on the same Triton kernels.
"""

from __future__ import annotations

import json

SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
#: Environment of every server process.
SERVER_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
COMPILATION_EAGER = {"custom_ops": ["none"]}
#: Piecewise CUDA graphs around attention: vLLM's compiled model with the compiled ops still off.
COMPILATION_PIECEWISE = {"custom_ops": ["none"], "cudagraph_mode": "PIECEWISE"}
IR_OP_PRIORITY = {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}
BLOCK_SIZE = 16


def common_args(
    max_model_len: int, graphs: bool = False, dummy_weights: bool = True, kv_cache_dtype: str | None = None
) -> list[str]:
    """Flags every server of the job shares; ``dummy_weights`` False loads the model folder's weights;
    ``kv_cache_dtype`` (e.g. ``fp8``) quantises the KV cache of vanilla and eviction alike."""
    args = [
        "--load-format", "dummy" if dummy_weights else "safetensors",
        "--compilation-config", json.dumps(COMPILATION_PIECEWISE if graphs else COMPILATION_EAGER),
        "--ir-op-priority", json.dumps(IR_OP_PRIORITY),
        "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(max_model_len),
    ]
    if kv_cache_dtype:
        args += ["--kv-cache-dtype", kv_cache_dtype]
    return args if graphs else [*args, "--enforce-eager"]


def vanilla_args(max_model_len: int, graphs: bool = False, dummy_weights: bool = True,
                 kv_cache_dtype: str | None = None) -> list[str]:
    """vLLM without eviction, on its Triton attention backend."""
    return [*common_args(max_model_len, graphs, dummy_weights, kv_cache_dtype),
            "--attention-backend", "TRITON_ATTN"]


def eviction_args(max_model_len: int, method: str = "ada-snapkv", budget: str = "0.25", graphs: bool = False,
                  dummy_weights: bool = True, kv_cache_dtype: str | None = None) -> list[str]:
    """The plugin's eviction on its CUDA backend (``CUSTOM``, what ``--kv-eviction`` selects on CUDA)."""
    return [*common_args(max_model_len, graphs, dummy_weights, kv_cache_dtype),
            "--attention-backend", "CUSTOM", "--kv-eviction", method, "--kv-budget", budget]


def pool_args(num_gpu_blocks: int) -> list[str]:
    """The same KV pool for every compared server: ``num_gpu_blocks`` blocks of :data:`BLOCK_SIZE`."""
    return ["--num-gpu-blocks-override", str(num_gpu_blocks)]
