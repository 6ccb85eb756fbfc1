"""Every wrapper of a vLLM function, in one place (vLLM 0.32.0): each names the function it wraps, the
version checked and why. Three groups, installed by the plugin (``plugin.py``), each once per process:

- ``install_vllm_fixes``: fixes of vLLM itself, in every process whether or not eviction is on (below);
- ``install_eviction_hooks``: the model runner and KV-cache manager hooks the eviction worker and manager
  need (bodies in ``runner_hooks.py``), only in a process whose config turns eviction on;
- ``install_cli_hooks``: the ``--kv-eviction`` flags and guard rails of ``vllm serve`` and ``LLM(...)``;
- ``on_engine_config``: the plugin's decision per engine config.

Seeded sampling of a prompt longer than one prefill chunk (issue 29). A request with a ``seed`` owns a
``torch.Generator``; vLLM samples every scheduled request each step, also one in the middle of its prefill,
and discards that token. To keep the seeded stream as if the discarded draw had not happened,
``GPUModelRunner._bookkeeping_sync`` rewinds the generator with ``gen.set_offset(gen.get_offset() - 4)``:
Philox (CUDA) generators have an offset, the CPU's Mersenne-Twister generators do not and raise
``RuntimeError: CPU Generator does not use offset`` — the engine dies. On CPU the sampler
(``TopKTopPSampler.forward_cpu``) draws from the generator with ``torch.randint``; saving the generator's
state before sampling and restoring it afterwards undoes the discarded draw exactly, so a seeded request
samples the same tokens whether its prompt came in one step or in many.

Engine configs built in this process (``on_engine_config``): the plugin decides whether to install eviction
from the config; an engine built in the plugin's own process (``LLM(...)`` without engine multiprocessing)
has no config yet when plugins load, so the decision waits for ``EngineArgs.create_engine_config``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

#: The vLLM release this plugin was built and tested against (every wrapper here and every reach-in of
#: ``vllm_private.py`` was checked on it); any other gets plain vLLM (``plugin.vllm_version_refusal``).
TESTED_VLLM_VERSION = "0.32.0"
#: marks on a wrapper, one per group: vLLM fixes (every process), eviction hooks (eviction on), CLI flags
_WRAPPED_MARK = "_kvevict_vllm_patch"
_EVICTION_MARK = "_kvevict_wrapped"
_CLI_MARK = "__kvevict_wrapped__"


def install_vllm_fixes() -> None:
    """Install the fixes of vLLM itself (idempotent; every process, eviction on or off)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # Wraps GPUModelRunner._sample (vLLM 0.32.0; CPUModelRunner inherits it): the last point before a
    # request's generator is drawn from. The state of every CPU generator of a request whose token this step
    # discards (a partial prefill) is saved before sampling and restored after it.
    _wrap(GPUModelRunner, "_sample", _sample_keeping_discarded_cpu_generators)
    # Wraps GPUModelRunner._bookkeeping_sync (vLLM 0.32.0): its rewind of discarded requests' generators
    # calls Generator.set_offset, which CPU generators do not have. Those generators were already restored
    # by the _sample wrapper, so they are hidden from the rewind; vLLM rewinds CUDA generators as before.
    _wrap(GPUModelRunner, "_bookkeeping_sync", _bookkeeping_without_cpu_rewind)


def install_eviction_hooks() -> None:
    """Install the eviction hooks (idempotent; a process whose config turns eviction on). Each body is in
    ``runner_hooks.py`` and does nothing unless this process has an eviction worker or manager."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_kvevict.vllm_adapter import runner_hooks

    # Wraps GPUModelRunner.initialize_kv_cache (vLLM 0.32.0; CPUModelRunner's calls it): the one call that
    # makes the runner's attention metadata builders (a profiling pass, then the real one), each from its
    # spec and config alone; they share one eviction worker made by the first, which the runner then holds
    # for the hooks below (no process-global worker; evicting_backend.builders_share).
    _wrap(GPUModelRunner, "initialize_kv_cache", runner_hooks.initialize_kv_cache, _EVICTION_MARK)
    # Wraps GPUModelRunner.execute_model (vLLM 0.32.0; CPUModelRunner inherits it): the scheduler output
    # names finished/aborted and preempted requests even on steps with no tokens, and the worker must drop
    # their sub-block state; the step's inputs are cleared afterwards so no later dummy run can reuse them.
    _wrap(GPUModelRunner, "execute_model", runner_hooks.execute_model, _EVICTION_MARK)
    # Wraps GPUModelRunner._prepare_inputs (vLLM 0.32.0, private): it runs after the persistent input batch is
    # updated and before attention metadata is built, the one point where request ids, prompt lengths and
    # computed token counts of this step are known in batch order.
    _wrap(GPUModelRunner, "_prepare_inputs", runner_hooks.prepare_inputs, _EVICTION_MARK)
    # Wraps GPUModelRunner.sample_tokens (vLLM 0.32.0; CPUModelRunner inherits it) and
    # Scheduler.update_from_output (vLLM 0.32.0): the step's ModelRunnerOutput is the one object that goes
    # from the worker to the scheduler. An adaptive plan (KVzap's threshold) keeps a count only the worker's
    # scores decide, so the worker puts each such request's kept bound on it and the scheduler hands it to
    # the evicting manager before processing the step (layout/accounting.py).
    _wrap(GPUModelRunner, "sample_tokens", runner_hooks.sample_tokens, _EVICTION_MARK)
    _wrap(Scheduler, "update_from_output", runner_hooks.update_from_output, _EVICTION_MARK)
    # Wraps GPUModelRunner.get_kv_cache_spec (vLLM 0.32.0): the worker calls it outside
    # set_current_vllm_config, but the backend's customize_spec reads the eviction config from the current
    # config to publish the evicting spec (without it the scheduler would never free a block); its result
    # is where a layer eviction cannot serve shows, before the engine starts.
    _wrap(GPUModelRunner, "get_kv_cache_spec", runner_hooks.get_kv_cache_spec, _EVICTION_MARK)
    # Wraps UnquantizedLinearMethod.process_weights_after_loading (vLLM 0.32.0): on CPU it prepacks the
    # weight for oneDNN and replaces ``layer.weight`` with an empty tensor (dispatch_cpu_unquantized_gemm,
    # remove_weight=True), so CriticalKV would find no o_proj weight; with CriticalKV each is copied first.
    _wrap(
        UnquantizedLinearMethod,
        "process_weights_after_loading",
        runner_hooks.process_weights_after_loading,
        _EVICTION_MARK,
    )
    # Wraps KVCacheManager.allocate_slots (vLLM 0.32.0, scheduler side): the one call that hands the KV
    # managers the Request itself and its prefix-cache hit (single-type managers only see request ids). The
    # evicting manager notes the request's per-request setting (sampling_params.extra_args) and the prompt
    # tokens it starts with from shared cached blocks before its blocks are counted.
    _wrap(KVCacheManager, "allocate_slots", runner_hooks.allocate_slots, _EVICTION_MARK)
    # Wraps KVCacheManager.get_computed_blocks (vLLM 0.32.0, scheduler side): a request whose plan rewrites
    # its blocks over time (eviction between chunks, a decode-time cap) must not start from cached prefix
    # blocks other requests share; it is marked skip_reading_prefix_cache (vLLM's own per-request switch)
    # before the lookup. Whole-prompt eviction reads the cache (layout/shared_prefix.py).
    _wrap(KVCacheManager, "get_computed_blocks", runner_hooks.get_computed_blocks, _EVICTION_MARK)
    # The same wrapper serves a request asking kv_context "keep": it starts from a kept context of its
    # setting (computed blocks: nulls, then the entry's blocks; layout/context_reuse.py) or computes all.
    # Wraps KVCacheManager.free (vLLM 0.32.0, scheduler side): the one call that sees a finished, aborted or
    # preempted Request (with its computed tokens) before its blocks go back; a kept-context creator whose
    # context was processed enters the prefix cache there if no later allocation published it already.
    _wrap(KVCacheManager, "free", runner_hooks.free_request, _EVICTION_MARK)
    # Wraps Scheduler.__init__ and Scheduler._mamba_block_aligned_split (vLLM 0.32.0, private): the split is
    # vLLM's one hook that clips a prefill chunk where a state must be saved (Mamba "align" mode; eviction
    # refuses Mamba models). With eviction the scheduler routes every prefill chunk through it
    # (need_mamba_block_aligned_split) and a prompt evicted chunk by chunk never runs past a multiple of its
    # chunk stride, so what it keeps does not depend on how the token budget cut it under load.
    _wrap(Scheduler, "__init__", runner_hooks.scheduler_init, _EVICTION_MARK)
    _wrap(Scheduler, "_mamba_block_aligned_split", runner_hooks.split_prefill_chunk, _EVICTION_MARK)


def install_cli_hooks() -> None:
    """Give ``vllm serve`` the eviction flags and every engine the guard rails (idempotent; the API server or
    a process that builds engines from Python). They pass everything through unchanged when no eviction is
    asked for."""
    import argparse

    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvevict.vllm_adapter.engine_setup import (
        apply_eviction_from_additional_config,
        apply_eviction_to_engine_args,
        mark_guarded,
    )
    from vllm_kvevict.vllm_adapter.eviction_flags import add_eviction_args

    if getattr(EngineArgs.add_cli_args, _CLI_MARK, False):
        return
    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.from_cli_args.__func__
    original_create = EngineArgs.create_engine_config

    # Wraps EngineArgs.add_cli_args (vLLM 0.32.0, staticmethod; vLLM has no registry for engine CLI flags):
    # AsyncEngineArgs.add_cli_args calls it by name after loading the general plugins, so the eviction
    # argument group shows up in ``vllm serve --help``.
    def add_cli_args(parser: Any) -> Any:
        parser = original_add(parser)
        add_eviction_args(parser)
        return parser

    # Wraps EngineArgs.from_cli_args (vLLM 0.32.0, classmethod inherited by AsyncEngineArgs): it keeps only
    # dataclass fields, so the flags would be dropped; they move into additional_config["kv_eviction"] and
    # the start-up guard rails apply (a refusal exits with one "vllm serve: error:" line).
    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        engine_args = original_from(cls, args)
        apply_eviction_to_engine_args(args, engine_args)
        mark_guarded(engine_args)
        return engine_args

    # Wraps EngineArgs.create_engine_config (vLLM 0.32.0): LLM(...) and AsyncLLM.from_engine_args build
    # their config here without from_cli_args, so the same guard rails apply first (UnsupportedEngineSetting).
    def create_engine_config(self: EngineArgs, *args: Any, **kwargs: Any) -> Any:
        apply_eviction_from_additional_config(self)
        return original_create(self, *args, **kwargs)

    setattr(add_cli_args, _CLI_MARK, True)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config


def on_engine_config(callback: Callable[[Any], object]) -> None:
    """Call ``callback(vllm_config)`` after every engine config this process builds (once installed)."""
    from vllm.engine.arg_utils import EngineArgs

    # Wraps EngineArgs.create_engine_config (vLLM 0.32.0, vllm/engine/arg_utils.py): ``vllm serve``,
    # ``LLM(...)`` and ``AsyncLLM.from_engine_args`` all build their VllmConfig here, before any engine
    # process starts; the wrapper only hands the result to ``callback`` (the plugin's eviction decision).
    def create_engine_config(original, engine_args, *args: Any, **kwargs: Any):
        vllm_config = original(engine_args, *args, **kwargs)
        callback(vllm_config)
        return vllm_config

    _wrap(EngineArgs, "create_engine_config", create_engine_config)


def _wrap(cls: type, name: str, body, mark: str = _WRAPPED_MARK) -> None:
    """Replace ``cls.name`` by a wrapper calling ``body(original, self, *args, **kwargs)`` once (``mark``)."""
    original = getattr(cls, name)
    if getattr(original, mark, False):
        return

    @functools.wraps(original)
    def wrapper(self, *args: Any, **kwargs: Any):
        return body(original, self, *args, **kwargs)

    setattr(wrapper, mark, True)
    setattr(cls, name, wrapper)


def discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """{batch index: generator} of this step's requests whose sampled token vLLM discards (partial prefill)
    and whose generator lives on the CPU."""
    generators = runner.input_batch.generators
    if not generators:
        return {}
    num_reqs = runner.input_batch.num_reqs
    discarded = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
    found = {}
    for index in discarded:
        generator = generators.get(int(index))
        if generator is not None and generator.device.type == "cpu":
            found[int(index)] = generator
    return found


def _sample_keeping_discarded_cpu_generators(original, runner, *args: Any, **kwargs: Any):
    generators = discarded_cpu_generators(runner)
    saved = {index: generator.get_state() for index, generator in generators.items()}
    try:
        return original(runner, *args, **kwargs)
    finally:
        for index, generator in generators.items():
            generator.set_state(saved[index])


def _bookkeeping_without_cpu_rewind(original, runner, *args: Any, **kwargs: Any):
    hidden = discarded_cpu_generators(runner)
    generators = runner.input_batch.generators
    for index in hidden:
        del generators[index]
    try:
        return original(runner, *args, **kwargs)
    finally:
        generators.update(hidden)
