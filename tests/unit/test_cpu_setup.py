"""The CPU set-up every server we start gets: dtype from the CPU's capabilities, tcmalloc when present."""

from __future__ import annotations

import platform

import pytest
import torch

from vllm_kvevict import cpu_setup as machine
from vllm_kvevict.cpu_setup import CPUSetup, cpu_setup, find_tcmalloc, native_bf16

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def fake_x86(monkeypatch: pytest.MonkeyPatch, *, amx: bool, avx512_bf16: bool, avx512: bool) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "avx512", "expected"),
    [
        (True, True, True, (True, "AMX tiles (amx_bf16)")),
        (False, True, True, (True, "avx512_bf16")),
        (False, False, True, (False, "AVX-512 without avx512_bf16")),
        (False, False, False, (False, "no AVX-512")),
    ],
)
def test_bf16_is_native_exactly_where_vllm_picks_its_bf16_kernels(
    monkeypatch, amx, avx512_bf16, avx512, expected
):
    fake_x86(monkeypatch, amx=amx, avx512_bf16=avx512_bf16, avx512=avx512)
    assert native_bf16() == expected


@pytest.mark.parametrize(("native", "dtype"), [(True, "bfloat16"), (False, "float32")])
def test_dtype_is_bf16_where_native_else_float32_and_logged_in_one_line(monkeypatch, capsys, native, dtype):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(machine, "native_bf16", lambda: (native, "probe"))
    monkeypatch.setattr(machine, "find_tcmalloc", lambda: None)
    setup = cpu_setup.__wrapped__()
    assert setup.dtype == dtype
    assert capsys.readouterr().err == f"{setup.summary()}\n"
    assert setup.summary().startswith(f"[cpu-setup] dtype {dtype}: probe")


def test_a_cuda_machine_keeps_vllms_dtype_and_allocator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    setup = cpu_setup.__wrapped__()
    assert setup.server_args() == ()
    assert setup.server_env({}) == {}


def test_a_dtype_given_by_the_caller_wins():
    setup = CPUSetup("float32", "probe", None)
    assert setup.server_args(("--max-model-len", "64")) == ("--dtype", "float32")
    assert setup.server_args(("--dtype", "bfloat16")) == ()
    assert setup.server_args(("--dtype=half",)) == ()


def test_tcmalloc_goes_in_front_of_what_is_preloaded_and_only_once():
    setup = CPUSetup("bfloat16", "probe", TCMALLOC)
    aot_set = {"VLLM_USE_AOT_COMPILE": "1"}  # the caller's choice, kept
    assert setup.server_env(aot_set) == {"LD_PRELOAD": TCMALLOC}
    assert setup.server_env({"LD_PRELOAD": "/x/libgomp.so", **aot_set}) == {
        "LD_PRELOAD": f"{TCMALLOC}:/x/libgomp.so"
    }
    assert setup.server_env({"LD_PRELOAD": "/opt/libtcmalloc.so", **aot_set}) == {}
    assert CPUSetup("bfloat16", "probe", None).server_env(aot_set) == {}


def test_a_cpu_server_compiles_without_vllms_aot_artifact_unless_told():
    setup = CPUSetup("float32", "probe", None)
    assert setup.server_env({}) == {"VLLM_USE_AOT_COMPILE": "0"}
    assert setup.server_env({"VLLM_USE_AOT_COMPILE": "1"}) == {}
    assert "AOT compile off" in setup.summary()
    assert "AOT" not in CPUSetup(None, "a CUDA device is present, vLLM picks", None).summary()


def test_the_makefile_gets_the_environment_as_words(monkeypatch, capsys):
    monkeypatch.setattr(machine, "cpu_setup", lambda: CPUSetup("float32", "probe", TCMALLOC))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert machine.main(["env"]) == 0
    assert capsys.readouterr().out.split() == [f"LD_PRELOAD={TCMALLOC}", "VLLM_USE_AOT_COMPILE=0"]
    assert machine.main(["preload"]) == 2


def test_tcmalloc_is_found_by_pattern_or_absent(monkeypatch, tmp_path):
    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.write_bytes(b"")
    monkeypatch.setattr(machine, "TCMALLOC_PATTERNS", (str(tmp_path / "nothing*"), str(tmp_path / "*.so.4")))
    assert find_tcmalloc() == str(library)
    monkeypatch.setattr(machine, "TCMALLOC_PATTERNS", (str(tmp_path / "nothing*"),))
    assert find_tcmalloc() is None


@pytest.mark.model
def test_every_launched_server_gets_this_machines_setup(model_dir):
    from vllm_kvevict.server_process import VLLMServer, free_port

    setup = cpu_setup()
    launcher = VLLMServer(model_dir, port=free_port())
    if setup.dtype is None:
        assert "--dtype" not in launcher.command
    else:
        assert launcher.command[launcher.command.index("--dtype") + 1] == setup.dtype
    assert launcher.env.get("LD_PRELOAD", "").startswith(setup.tcmalloc or "")
    plain = VLLMServer(model_dir, port=free_port(), cpu_setup=False)
    assert "--dtype" not in plain.command
