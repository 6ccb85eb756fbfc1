"""The ``vllm.general_plugins`` entry point: runs in every vLLM process (API server, EngineCore, workers).

It only registers things; nothing changes unless eviction is configured (``--kv-eviction`` or
``additional_config.kv_eviction``). vLLM may call it several times per process, so every step is idempotent.
"""

from __future__ import annotations


def register() -> None:
    from vllm_kvevict.vllm_adapter import cli_hooks, kv_spec

    cli_hooks.install()
    kv_spec.register_evicting_spec()
    _register_worker_side()


def _register_worker_side() -> None:
    """The attention backend and the model-runner hooks (vllm_adapter/backend_cpu.py, runner_hooks.py)."""
    from vllm.platforms import current_platform

    from vllm_kvevict.vllm_adapter import runner_hooks

    if current_platform.is_cpu():
        from vllm_kvevict.vllm_adapter.backend_cpu import register_cpu_backend

        register_cpu_backend()
    elif current_platform.is_cuda():
        from vllm_kvevict.vllm_adapter.backend_cuda import register_cuda_backend

        register_cuda_backend()  # selected with --attention-backend CUSTOM
    runner_hooks.install()
