"""What the plugin (``vllm_adapter/plugin.py``) changes in a vLLM process, eviction off and on (issue 29).

Each scenario runs in a fresh interpreter (what vLLM patched stays patched for the process), with vLLM's own
plugin loading pointed away from this plugin (``VLLM_PLUGINS``) so that the test calls ``register()`` the
way vLLM does, from the frame vLLM calls it from. It prints what vLLM would run: where ``CPU_ATTN``
points, and which wrappers exist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_kvevict.vllm_adapter.plugin import TESTED_VLLM_VERSION, vllm_version_refusal

STATE = textwrap.dedent(
    """
    import json
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.attention.backends import cpu_attn
    from vllm_kvevict.vllm_adapter import plugin

    def state():
        return {
            "cpu_attn": AttentionBackendEnum.CPU_ATTN.get_path(),
            "runner_hooks": hasattr(GPUModelRunner._prepare_inputs, "_kvevict_wrapped"),
            "scheduler_hooks": hasattr(KVCacheManager.allocate_slots, "_kvevict_wrapped"),
            "cli_flags": hasattr(EngineArgs.add_cli_args, "__kvevict_wrapped__"),
            "seed_fix": hasattr(GPUModelRunner._sample, "_kvevict_vllm_patch"),
            "isa_choice": hasattr(cpu_attn._get_attn_isa, "_kvevict_vllm_patch"),  # vLLM's own, always
        }

    def engine_config(model, eviction=None):
        additional = {"kv_eviction": eviction} if eviction else {}
        return EngineArgs(model=model, dtype="float32", additional_config=additional).create_engine_config()
    """
)
VLLM_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
EVICTING_CPU_ATTN = "vllm_kvevict.vllm_adapter.backend_cpu.EvictingCPUAttentionBackend"
EVICTION = {"method": "snapkv", "budget": 256}


def run_scenario(body: str, model_dir) -> dict:
    """Run STATE + ``body`` (which prints one JSON line per observation) in a fresh interpreter."""
    env = {**os.environ, "VLLM_PLUGINS": "none-of-them", "KVEVICT_TEST_MODEL": str(model_dir)}
    result = subprocess.run(
        [sys.executable, "-c", STATE + textwrap.dedent(body)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    observations = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            observations.update(json.loads(line))
    return {**observations, "stderr": result.stderr}


@pytest.fixture(scope="module")
def api_server_process(model_dir) -> dict:
    """The API server's path: plugins load while the parser is built (no config yet), then the engine config
    is built without eviction, then (an LLM(...) in the same process) with it."""
    return run_scenario(
        f"""
        import os
        model = os.environ["KVEVICT_TEST_MODEL"]
        plugin.register()
        print(json.dumps({{"loaded": state()}}))
        engine_config(model)
        print(json.dumps({{"off": state()}}))
        engine_config(model, {EVICTION!r})
        print(json.dumps({{"on": state()}}))
        """,
        model_dir,
    )


def test_with_eviction_off_vllm_keeps_its_backend_and_no_wrapper_is_installed(api_server_process):
    for moment in ("loaded", "off"):
        state = api_server_process[moment]
        assert state["cpu_attn"] == VLLM_CPU_ATTN
        assert not state["runner_hooks"] and not state["scheduler_hooks"] and not state["isa_choice"]


def test_the_api_server_parses_the_eviction_flags_and_fixes_seeded_sampling(api_server_process):
    assert api_server_process["loaded"]["cli_flags"]
    assert api_server_process["loaded"]["seed_fix"]


def test_an_engine_config_with_eviction_installs_it_in_its_process(api_server_process):
    state = api_server_process["on"]
    assert state["cpu_attn"] == EVICTING_CPU_ATTN
    assert state["runner_hooks"] and state["scheduler_hooks"] and not state["isa_choice"]


@pytest.fixture(scope="module")
def engine_processes(model_dir) -> dict:
    """EngineCore and worker processes: vLLM loads the plugins from a frame holding their ``vllm_config``."""
    return run_scenario(
        f"""
        import os
        model = os.environ["KVEVICT_TEST_MODEL"]
        off, on = engine_config(model), engine_config(model, {EVICTION!r})

        def engine_core_init(vllm_config):  # as EngineCore.__init__ calls load_general_plugins()
            plugin.register()

        engine_core_init(off)
        print(json.dumps({{"off": state()}}))
        engine_core_init(on)
        print(json.dumps({{"on": state()}}))
        """,
        model_dir,
    )


def test_an_engine_process_without_eviction_runs_plain_vllm(engine_processes):
    state = engine_processes["off"]
    assert state["cpu_attn"] == VLLM_CPU_ATTN
    assert not state["runner_hooks"] and not state["scheduler_hooks"] and not state["cli_flags"]
    assert state["seed_fix"]


def test_an_engine_process_whose_config_asks_for_eviction_installs_it(engine_processes):
    state = engine_processes["on"]
    assert state["cpu_attn"] == EVICTING_CPU_ATTN
    assert state["runner_hooks"] and state["scheduler_hooks"]


def test_another_vllm_version_gets_one_line_and_plain_vllm(model_dir):
    observed = run_scenario(
        """
        import os
        plugin.installed_vllm_version = lambda: "0.33.1"
        plugin.register()
        plugin.register()
        engine_config(os.environ["KVEVICT_TEST_MODEL"])  # plain vLLM still builds its engine config
        print(json.dumps({"after": state()}))
        """,
        model_dir,
    )
    state = observed["after"]
    assert state["cpu_attn"] == VLLM_CPU_ATTN
    assert not any(state[name] for name in ("runner_hooks", "scheduler_hooks", "cli_flags", "seed_fix"))
    lines = [line for line in observed["stderr"].splitlines() if "vllm-kvevict: vLLM 0.33.1" in line]
    assert len(lines) == 1, observed["stderr"][-2000:]


def test_a_model_eviction_cannot_serve_is_refused_in_one_line_when_the_config_is_built(model_dir):
    observed = run_scenario(
        f"""
        import os
        from vllm_kvevict.vllm_adapter import model_support
        model_support.model_refusal = lambda model_config: "kv eviction refused: a feature; what is supported"
        plugin.register()
        try:
            engine_config(os.environ["KVEVICT_TEST_MODEL"], {EVICTION!r})
        except ValueError as exc:
            print(json.dumps({{"error": str(exc), "state": state()}}))
        """,
        model_dir,
    )
    assert observed["error"] == "kv eviction refused: a feature; what is supported"
    assert observed["state"]["cpu_attn"] == VLLM_CPU_ATTN


@pytest.mark.parametrize(
    ("version", "refused"),
    [("0.32.0", False), ("0.32.0+cpu", False), ("0.32.1", True), ("0.33.0", True), (None, True)],
)
def test_only_the_tested_vllm_release_is_accepted(version, refused):
    line = vllm_version_refusal(version)
    assert (line is not None) == refused
    if refused:
        assert TESTED_VLLM_VERSION in line and "\n" not in line and "vLLM serves unchanged" in line
