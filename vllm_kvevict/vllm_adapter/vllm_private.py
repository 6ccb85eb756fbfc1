"""Every read or call of a private part of vLLM that is not a wrapper (those are in ``vllm_patches.py``), in
one place: each names the vLLM symbol, the version checked (``TESTED_VLLM_VERSION``, 0.32.0) and why the
public API does not do. Every part of vLLM the plugin relies on is listed in ``vllm_boundary/``, which a
test checks against the installed vLLM: a vLLM upgrade starts there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch

#: our attribute on vLLM's model runner holding its eviction worker (``runner_worker``)
_RUNNER_WORKER = "_kvevict_worker"


def runner_worker(runner: Any) -> Any:
    """The eviction worker a model runner holds (None: none, eviction off or its KV cache not set up yet).

    An attribute of ours on ``GPUModelRunner`` (vLLM 0.32.0: a plain object, ``CPUModelRunner`` subclasses
    it): the runner is all vLLM hands the runner hooks (``runner_hooks.py``), and it has no public place for
    a plugin's state; its metadata builders, which hold the worker, are reached only through its private
    ``attn_groups``."""
    return getattr(runner, _RUNNER_WORKER, None)


def hold_runner_worker(runner: Any, worker: Any) -> None:
    """``runner`` holds ``worker`` from now on (``runner_worker``)."""
    setattr(runner, _RUNNER_WORKER, worker)


def async_output_target(output: Any) -> Any:
    """The ``ModelRunnerOutput`` the scheduler will get for ``output`` (itself unless it is an async output).

    ``AsyncGPUModelRunnerOutput._model_runner_output`` (vLLM 0.32.0): an async output holds the output it
    resolves to and has no public accessor before ``get_output()``, which waits for the device; the worker
    puts its kept bounds on it (``runner_hooks.sample_tokens``)."""
    return getattr(output, "_model_runner_output", output)


def single_type_managers(kv_cache_manager: Any) -> Sequence[Any]:
    """The per-group managers behind a scheduler's ``KVCacheManager`` (the evicting ones among them).

    ``KVCacheManager.coordinator.single_type_managers`` (vLLM 0.32.0): the KV-cache manager hands its
    managers request ids only, and the hooks that see a ``Request`` reach the evicting managers through it
    (``runner_hooks.py``)."""
    return kv_cache_manager.coordinator.single_type_managers


def insert_block_hash(block_pool: Any, block_hash: bytes, block: Any) -> None:
    """Register ``block`` in the prefix cache under ``block_hash`` (a hash with group id).

    ``BlockPool._insert_block_hash(block_hash, block, num_tokens=None)`` (vLLM 0.32.0): how
    ``cache_full_blocks`` registers a block; the public ``cache_full_blocks`` hashes tokens, and a kept
    context's blocks hold a compacted context no token hash describes (``kept_contexts.py``)."""
    block_pool._insert_block_hash(block_hash, block, num_tokens=None)


def remove_blocks_in_range(manager: Any, request_id: str, first_block: int, last_block: int) -> None:
    """Free a request's blocks ``[first_block, last_block)`` and put null blocks in their places.

    ``SingleTypeKVCacheManager._remove_blocks_in_range`` (vLLM 0.32.0): what the in-tree managers free with
    (RSWAManager frees a middle gap the same way); there is no public call that frees part of a request's
    blocks (``evicting_kv_manager.py``)."""
    manager._remove_blocks_in_range(request_id, first_block, last_block)


def fill_spec_registry() -> None:
    """Register vLLM's own KV-cache specs before ours.

    ``KVCacheSpecRegistry._ensure_registered()`` (vLLM 0.32.0): the registry fills itself with the built-in
    specs lazily, only while it is empty, so registering ``EvictingAttentionSpec`` first would hide them in
    the worker (``evicting_kv_manager.register_evicting_spec``)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()


def rotary_inv_freq(module: Any) -> torch.Tensor:
    """[rotary_dim / 2] float32 inverse frequencies of a rotary embedding, as vLLM computes them.

    ``RotaryEmbeddingBase._compute_inv_freq(base)`` (vLLM 0.32.0): each scaling variant (YaRN, Llama 3, ...)
    overrides it, and the module keeps only the cos/sin cache, so it is the one place the frequencies with
    the model's scaling exist (Expected Attention takes RoPE out of keys, ``runner_hooks.rope_inv_freq``)."""
    return module._compute_inv_freq(module.base).float()


def kv_scales(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value scales of an attention layer's cache, as tensors.

    ``Attention._k_scale`` / ``_v_scale`` (vLLM 0.32.0): the layer passes itself to the impl, and vLLM's own
    Triton impl reads its scales the same way to write and read a quantised cache (``backend_cuda.py``)."""
    return layer._k_scale, layer._v_scale


def kv_scales_float(layer: Any) -> tuple[float, float]:
    """The key and value scales of an attention layer's cache, as floats.

    ``Attention._k_scale_float`` / ``_v_scale_float`` (vLLM 0.32.0): vLLM's own CPU impl reads them the same
    way for ``cpu_attn_reshape_and_cache`` and ``cpu_attention_with_kv_cache`` (``backend_cpu.py``)."""
    return layer._k_scale_float, layer._v_scale_float


def parser_has_option(parser: argparse.ArgumentParser, option: str) -> bool:
    """True when ``parser`` already has the flag ``option``.

    ``ArgumentParser._actions`` (argparse; vLLM 0.32.0's ``FlexibleArgumentParser`` keeps it): vLLM builds the
    ``vllm serve`` parser with ``EngineArgs.add_cli_args`` more than once in a process, and argparse has no
    public way to ask for an option (``eviction_flags.add_eviction_args`` adds its group once)."""
    return any(option in action.option_strings for action in parser._actions)


def vllm_config_of_caller(max_depth: int = 8) -> Any:
    """The ``VllmConfig`` of the vLLM frame that loaded the plugins, or None (API server, plain Python).

    vLLM 0.32.0 calls ``load_general_plugins()`` from ``EngineCore.__init__(vllm_config, ...)`` and from
    ``WorkerWrapperBase.init_worker``, which has just bound ``vllm_config``: the process's config is a local
    of that frame (``sys._getframe``), and a plugin is handed no config. The API server loads them while
    building its parser, before any config exists (``plugin.py``)."""
    from vllm.config import VllmConfig

    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("vllm_config")
        if isinstance(candidate, VllmConfig):
            return candidate
        frame = frame.f_back
    return None
