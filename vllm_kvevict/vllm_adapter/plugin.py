"""The ``vllm.general_plugins`` entry point: runs once in each vLLM process (API server, EngineCore, workers).

What each process gets:
- every process: the fixes of vLLM itself (``vllm_patches.py``; they apply with eviction off too);
- a process that parses ``vllm serve``'s flags or builds an engine config (the API server, a Python process
  calling ``LLM(...)``): the ``--kv-eviction`` flags and guard rails (``vllm_patches.install_cli_hooks``),
  which pass everything through unchanged when no eviction is asked for;
- the eviction machinery (the evicting KV-cache spec and its manager, the attention backend re-pointed,
  the model-runner hooks) only in a process whose vLLM config has ``additional_config["kv_eviction"]``:
  ``--kv-eviction`` becomes that entry, and the config travels to every EngineCore and worker process.
  With eviction off, vLLM's ``CPU_ATTN`` stays vLLM's and no runner or scheduler wrapper exists. A model
  eviction cannot serve is refused there with one line (``model_support.py``).

vLLM may call ``load_general_plugins`` several times per process (it runs the plugins once), and the
engine config may be built more than once; every step is idempotent.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_kvevict.vllm_adapter.vllm_patches import TESTED_VLLM_VERSION

logger = logging.getLogger("vllm.kvevict")
_state = {"eviction_installed": False, "version_refused": False}


def register() -> None:
    refusal = vllm_version_refusal(installed_vllm_version())
    if refusal is not None:
        if not _state["version_refused"]:
            _state["version_refused"] = True
            logger.warning("%s", refusal)
        return
    from vllm_kvevict.vllm_adapter import vllm_patches, vllm_private

    vllm_patches.install_vllm_fixes()
    vllm_config = vllm_private.vllm_config_of_caller()
    if vllm_config is not None:
        # EngineCore or a worker: the config it was started with decides.
        install_eviction_if_configured(vllm_config)
        return
    vllm_patches.install_cli_hooks()
    # An engine built in this process (LLM(...) without engine multiprocessing) loads its plugins before
    # any config exists; the config decides once it is built.
    vllm_patches.on_engine_config(install_eviction_if_configured)


def installed_vllm_version() -> str | None:
    try:
        from vllm.version import __version__
    except Exception:  # an install without the module: treated as an unknown version
        return None
    return str(__version__)


def vllm_version_refusal(version: str | None) -> str | None:
    """None for the tested release (local build tags such as ``+cpu`` ignored), else the one start-up line."""
    base = (version or "").split("+", 1)[0]
    if base == TESTED_VLLM_VERSION:
        return None
    return (
        f"vllm-kvevict: vLLM {version or 'of unknown version'} is not the tested {TESTED_VLLM_VERSION}; "
        "KV-cache eviction is off and --kv-eviction is not available, vLLM serves unchanged"
    )


def install_eviction_if_configured(vllm_config: Any) -> bool:
    """Install the eviction machinery in this process when ``vllm_config`` asks for eviction; True if it
    is installed (now or before). A model or setting eviction cannot serve raises ModelRefusedError with one
    line (``model_support.eviction_refusal``, ``learned_scorer.learned_scorer_refusal``) before any weight is
    loaded."""
    from vllm_kvevict.settings.additional_config import get_eviction_config
    from vllm_kvevict.vllm_adapter.learned_scorer import learned_scorer_refusal
    from vllm_kvevict.vllm_adapter.model_support import ModelRefusedError, eviction_refusal

    if get_eviction_config(vllm_config) is None:
        return _state["eviction_installed"]
    refusal = eviction_refusal(vllm_config) or learned_scorer_refusal(vllm_config)
    if refusal is not None:
        logger.error("%s", refusal)
        raise ModelRefusedError(refusal)
    if _state["eviction_installed"]:
        return True
    _install_eviction()
    _state["eviction_installed"] = True
    return True


def eviction_installed() -> bool:
    return _state["eviction_installed"]


def _install_eviction() -> None:
    """The KV-cache spec with its manager, the attention backend and the model-runner hooks
    (kv_spec.py, evicting_kv_manager.py, backend_cpu.py / backend_cuda.py, the eviction hooks of
    vllm_patches.py)."""
    from vllm.platforms import current_platform

    from vllm_kvevict.vllm_adapter import evicting_kv_manager, vllm_patches

    evicting_kv_manager.register_evicting_spec()
    if current_platform.is_cpu():
        from vllm_kvevict.vllm_adapter.backend_cpu import register_cpu_backend

        register_cpu_backend()
    elif current_platform.is_cuda_alike():
        from vllm_kvevict.vllm_adapter.backend_cuda import register_cuda_backend

        register_cuda_backend()  # selected with --attention-backend CUSTOM
    vllm_patches.install_eviction_hooks()
