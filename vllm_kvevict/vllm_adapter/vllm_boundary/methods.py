"""The methods of vLLM the plugin wraps (``vllm_patches.py``), overrides (subclasses and mixins of ours) or
calls (private ones, ``vllm_private.py``), each with its parameters as vLLM defines them."""

from __future__ import annotations

from vllm_kvevict.vllm_adapter.vllm_boundary import owners
from vllm_kvevict.vllm_adapter.vllm_boundary.part import VllmPart, methods

_FULL_MANAGER = "vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager"
_LOGITS = "vllm.v1.sample.logits_processor.LogitsProcessor"
_IMPL_INIT = (
    "num_heads head_size scale num_kv_heads alibi_slopes sliding_window kv_cache_dtype logits_soft_cap"
)
_IMPL_INIT += " attn_type kv_sharing_target_layer_name sinks"
_FORWARD = "layer query key value kv_cache attn_metadata output output_scale output_block_scale"
_KV_UPDATE = "layer key value kv_cache slot_mapping"
_BUILDER_INIT = "kv_cache_spec layer_names vllm_config device"
_BUILD = "common_prefix_len common_attn_metadata fast_build"

_WRAPPER = "vllm_patches.py says what each wrapper does and why"
WRAPPED: tuple[VllmPart, ...] = (
    *methods(
        "wraps",
        owners.RUNNER,
        _WRAPPER,
        {
            "_sample": "logits spec_decode_metadata",
            "_bookkeeping_sync": "scheduler_output sampler_output logits hidden_states num_scheduled_tokens",
            "initialize_kv_cache": "kv_cache_config is_profiling kv_cache_allocation_context",
            "execute_model": "scheduler_output intermediate_tensors",
            "_prepare_inputs": "scheduler_output num_scheduled_tokens",
            "sample_tokens": "grammar_output",
            "get_kv_cache_spec": "",
        },
    ),
    *methods(
        "wraps",
        owners.SCHEDULER,
        _WRAPPER,
        {
            "update_from_output": "scheduler_output model_runner_output",
            "__init__": "vllm_config kv_cache_config structured_output_manager block_size hash_block_size "
            "mm_registry include_finished_set log_stats",
            "_mamba_block_aligned_split": "request num_new_tokens num_new_local_computed_tokens "
            "num_external_computed_tokens",
        },
    ),
    *methods(
        "wraps",
        owners.KV_MANAGER,
        _WRAPPER,
        {
            "allocate_slots": "request num_new_tokens num_new_computed_tokens new_computed_blocks "
            "num_lookahead_tokens num_external_computed_tokens delay_cache_blocks num_encoder_tokens "
            "full_sequence_must_fit reserved_blocks has_scheduled_reqs skip_zeroing_group_ids",
            "get_computed_blocks": "request",
            "free": "request",
        },
    ),
    *methods(
        "wraps",
        owners.ENGINE_ARGS,
        _WRAPPER,
        {"add_cli_args": "parser", "from_cli_args": "args", "create_engine_config": "usage_context headless"},
    ),
    VllmPart(
        "wraps",
        "vllm.model_executor.layers.linear.UnquantizedLinearMethod",
        "process_weights_after_loading",
        _WRAPPER,
        params="layer",
    ),
)

_BACKEND = "backend_cpu/backend_cuda through evicting_backend: the evicting impl, builder and spec"
_IMPL = "evicting_backend: refusals, head-as-sequence writes and attention, eviction after attention"
OVERRIDDEN: tuple[VllmPart, ...] = (
    *methods(
        "overrides",
        _FULL_MANAGER,
        "evicting_kv_manager: frees blocks by the accounting rule, spare blocks, kept contexts",
        {
            "__init__": "kv_cache_spec block_pool enable_caching kv_cache_group_id scheduler_block_size "
            "dcp_world_size pcp_world_size needs_kv_cache_zeroing max_admission_blocks_per_request",
            "add_local_computed_blocks": "request_id new_computed_blocks num_local_computed_tokens "
            "num_external_computed_tokens",
            "cache_blocks": "request num_tokens retention_interval replay_boundaries",
            "remove_skipped_blocks": "request_id processed_computed_tokens num_prompt_tokens",
            "get_num_blocks_to_allocate": "request_id num_tokens new_computed_blocks total_computed_tokens "
            "num_local_computed_tokens num_tokens_main_model apply_admission_cap prefill_end",
            "allocate_new_blocks": "request_id num_tokens num_tokens_main_model",
            "free": "request_id",
        },
    ),
    *methods(
        "overrides",
        "vllm.v1.kv_cache_interface.FullAttentionSpec",
        "kv_spec: a group's layers share one setting; the block table's spare columns",
        {"merge": "specs", "max_num_blocks_per_req": "vllm_config max_len"},
    ),
    *methods(
        "overrides",
        f"{owners.CPU}.CPUAttentionBackend",
        _BACKEND,
        {"get_impl_cls": "", "get_builder_cls": "", "customize_spec": "spec"},
    ),
    *methods(
        "overrides",
        f"{owners.TRITON}.TritonAttentionBackend",
        _BACKEND + "; named CUSTOM",
        {"get_impl_cls": "", "get_builder_cls": "", "customize_spec": "spec", "get_name": ""},
    ),
    *methods(
        "overrides",
        f"{owners.CPU}.CPUAttentionMetadataBuilder",
        _BACKEND,
        {"__init__": _BUILDER_INIT, "build": _BUILD},
    ),
    *methods(
        "overrides",
        f"{owners.TRITON}.TritonAttentionMetadataBuilder",
        _BACKEND,
        {"__init__": _BUILDER_INIT, "build": _BUILD},
    ),
    *methods(
        "overrides",
        f"{owners.CPU}.CPUAttentionBackendImpl",
        _IMPL,
        {"__init__": _IMPL_INIT, "do_kv_cache_update": _KV_UPDATE, "forward": _FORWARD},
    ),
    *methods(
        "overrides",
        f"{owners.TRITON}.TritonAttentionImpl",
        _IMPL,
        {
            "__init__": _IMPL_INIT + " use_alibi_sqrt chunk_lookback",
            "do_kv_cache_update": _KV_UPDATE,
            "forward": _FORWARD,
        },
    ),
    *methods(
        "overrides",
        _LOGITS,
        "request_validation: vLLM's per-request validation (HTTP 400) in a processor that changes no logits",
        {
            "validate_params": "sampling_params",
            "__init__": "vllm_config device is_pin_memory",
            "apply": "logits",
            "is_argmax_invariant": "",
            "update_state": "batch_update",
        },
    ),
)

CALLED: tuple[VllmPart, ...] = (
    VllmPart(
        "calls",
        "vllm.v1.core.block_pool.BlockPool",
        "_insert_block_hash",
        "vllm_private.insert_block_hash: a kept context's blocks enter the prefix cache",
        params="block_hash_with_group_id block num_tokens",
    ),
    VllmPart(
        "calls",
        "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager",
        "_remove_blocks_in_range",
        "vllm_private.remove_blocks_in_range: free part of a request's blocks",
        params="request_id first_block last_block",
    ),
    *methods(
        "calls",
        "vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry",
        "evicting_kv_manager.register_evicting_spec, after vllm_private.fill_spec_registry",
        {
            "_ensure_registered": "vllm_config",
            "register": "kvcache_spec_cls manager_class uniform_type_base_spec",
        },
    ),
    VllmPart(
        "calls",
        "vllm.model_executor.layers.rotary_embedding.base.RotaryEmbeddingBase",
        "_compute_inv_freq",
        "vllm_private.rotary_inv_freq: RoPE frequencies with the model's scaling",
        params="base",
    ),
    VllmPart(
        "calls",
        owners.KV_MANAGER,
        "create_kv_cache_blocks",
        "runner_hooks: a kept context's hit",
        params="blocks",
    ),
    VllmPart("calls", owners.RUNNER, "get_model", "runner_hooks: o_proj weights, RoPE frequencies"),
)
