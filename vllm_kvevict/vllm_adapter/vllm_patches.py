"""Every wrapper of a private vLLM function that fixes vLLM itself, in one place (vLLM 0.32.0).

These apply whether or not eviction is on; each wrapper names the function it wraps, the version checked and
why. They are installed by the plugin (``plugin.py``) in every process, once.

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

TESTED_VLLM_VERSION = "0.32.0"
_WRAPPED_MARK = "_kvevict_vllm_patch"


def install() -> None:
    """Install every wrapper (idempotent; every process)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # Wraps GPUModelRunner._sample (vLLM 0.32.0; CPUModelRunner inherits it): the last point before a
    # request's generator is drawn from. The state of every CPU generator of a request whose token this step
    # discards (a partial prefill) is saved before sampling and restored after it.
    _wrap(GPUModelRunner, "_sample", _sample_keeping_discarded_cpu_generators)
    # Wraps GPUModelRunner._bookkeeping_sync (vLLM 0.32.0): its rewind of discarded requests' generators
    # calls Generator.set_offset, which CPU generators do not have. Those generators were already restored
    # by the _sample wrapper, so they are hidden from the rewind; vLLM rewinds CUDA generators as before.
    _wrap(GPUModelRunner, "_bookkeeping_sync", _bookkeeping_without_cpu_rewind)


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


def choose_cpu_attention_isa(choose: Callable[[str], str]) -> None:
    """Let ``choose(vllm_isa)`` overrule vLLM's CPU attention ISA (with eviction on: ``model_support``)."""
    from vllm.v1.attention.backends import cpu_attn

    # Wraps vllm.v1.attention.backends.cpu_attn._get_attn_isa (vLLM 0.32.0): CPUAttentionMetadataBuilder
    # calls it by module name to pick the cache packing its layers write and read. On a CPU with AMX tiles it
    # answers "amx" for bf16, a VNNI packing eviction has no row view for (per-chunk and decode-time
    # eviction would fail mid-request); the wrapper lets eviction choose "vec", the same cache shape and
    # kernels bf16 uses on every AVX-512 CPU without AMX.
    original = cpu_attn._get_attn_isa
    if getattr(original, _WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def get_attn_isa(*args: Any, **kwargs: Any) -> str:
        return choose(original(*args, **kwargs))

    setattr(get_attn_isa, _WRAPPED_MARK, True)
    cpu_attn._get_attn_isa = get_attn_isa


def _wrap(cls: type, name: str, body) -> None:
    original = getattr(cls, name)
    if getattr(original, _WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def wrapper(self, *args: Any, **kwargs: Any):
        return body(original, self, *args, **kwargs)

    setattr(wrapper, _WRAPPED_MARK, True)
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
