"""The attributes of vLLM's objects the plugin reads or sets, class by class, with why."""

from __future__ import annotations

from vllm_kvevict.vllm_adapter.vllm_boundary import owners
from vllm_kvevict.vllm_adapter.vllm_boundary.part import VllmPart, read

READ: tuple[VllmPart, ...] = (
    read(
        owners.RUNNER,
        "input_batch requests vllm_config device model discard_request_mask",
        "runner_hooks, vllm_patches, echo_forward: the step's batch, its requests, the model",
    ),
    read(
        "vllm.v1.worker.gpu_input_batch.InputBatch",
        "req_ids num_reqs num_prompt_tokens num_computed_tokens_cpu token_ids_cpu block_table generators",
        "runner_hooks.prepare_inputs: request ids, prompt lengths and counts in batch order (no metadata "
        "builder sees them); vllm_patches: the generators of discarded samples",
    ),
    read(
        "vllm.v1.worker.block_table.BlockTable",
        "num_blocks_per_row",
        "runner_hooks.prepare_inputs: blocks each request's row holds",
    ),
    read("vllm.v1.worker.gpu_input_batch.CachedRequestState", "sampling_params", "a request's xargs"),
    read("vllm.sampling_params.SamplingParams", "extra_args", "the per-request setting rides there"),
    read(
        "vllm.v1.worker.gpu_model_runner.AsyncGPUModelRunnerOutput",
        "_model_runner_output",
        "vllm_private.async_output_target: the output the scheduler gets carries the kept bounds",
    ),
    read(
        "vllm.v1.core.sched.output.SchedulerOutput",
        "finished_req_ids preempted_req_ids",
        "runner_hooks.execute_model: the worker drops their state",
    ),
    read(owners.KV_MANAGER, "coordinator", "vllm_private.single_type_managers: the managers behind it"),
    read(
        "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator",
        "single_type_managers",
        "vllm_private.single_type_managers: one manager per KV-cache group, the evicting one among them",
    ),
    read(
        owners.SCHEDULER,
        "kv_cache_manager has_mamba_layers need_mamba_block_aligned_split",
        "runner_hooks: the evicting managers; every prefill chunk through the split hook",
    ),
    read(
        "vllm.v1.request.Request",
        "request_id sampling_params num_computed_tokens num_prompt_tokens num_tokens block_hashes "
        "skip_reading_prefix_cache get_skip_reading_prefix_cache num_in_flight_tokens",
        "runner_hooks, evicting_kv_manager: a request's setting, counts and prefix-cache switch",
    ),
    read(
        "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager",
        "req_to_blocks block_pool kv_cache_group_id enable_caching",
        "evicting_kv_manager: its own blocks and pool",
    ),
    read(
        "vllm.v1.core.block_pool.BlockPool",
        "enable_caching null_block hash_block_size num_gpu_blocks get_num_free_blocks",
        "evicting_kv_manager, kept_contexts: kept contexts, spare blocks, the saved-blocks metric",
    ),
    read(
        "vllm.v1.core.kv_cache_utils.KVCacheBlock",
        "block_hash is_null",
        "kept_contexts: an entry is served while its blocks keep their hashes",
    ),
    read(
        "vllm.model_executor.layers.attention.attention.Attention",
        "layer_name _k_scale _v_scale _k_scale_float _v_scale_float",
        "vllm_private.kv_scales: an fp8 cache is written and read through the layer's scales",
    ),
    read(
        "vllm.model_executor.layers.attention.attention.Attention",
        "isa",
        "backend_cpu: the layer's cache packing, set by vLLM's CPU impl",
        set_in=owners.CPU,
    ),
    read(
        "vllm.v1.attention.backend.AttentionImpl",
        "num_kv_heads num_heads head_size scale kv_cache_dtype",
        "evicting_backend: the impl's shape and cache dtype",
        set_in=owners.CPU,
    ),
    read(
        f"{owners.CPU}.CPUAttentionBackendImpl",
        "num_queries_per_kv attn_type logits_soft_cap alibi_slopes sinks sliding_window",
        "evicting_backend, backend_cpu: refusals and the attention call",
    ),
    read(
        f"{owners.TRITON}.TritonAttentionImpl",
        "num_queries_per_kv attn_type logits_soft_cap fp8_dtype _kv_quant_mode",
        "backend_cuda: the attention call of an fp8 cache",
    ),
    read(
        "vllm.v1.attention.backend.CommonAttentionMetadata",
        "num_reqs num_actual_tokens seq_lens block_table_tensor slot_mapping",
        "evicting_backend: the step's batch",
    ),
    read("vllm.forward_context.ForwardContext", "attn_metadata", "evicting_backend.step_of"),
    read(
        "vllm.config.compilation.CompilationConfig",
        "static_forward_context splitting_ops cudagraph_mode",
        "echo_forward: every attention layer; engine_requirements: attention stays out of graphs",
    ),
    read(
        "vllm.model_executor.layers.rotary_embedding.base.RotaryEmbeddingBase",
        "base is_neox_style",
        "runner_hooks.rope_inv_freq",
    ),
    read(
        owners.ENGINE_ARGS,
        "additional_config attention_backend compilation_config enable_chunked_prefill enable_prefix_caching "
        "enforce_eager logits_processors pipeline_parallel_size tensor_parallel_size speculative_config",
        "engine_setup, engine_requirements: the eviction setting and its guard rails",
    ),
)
