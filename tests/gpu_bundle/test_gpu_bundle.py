"""The GPU bundle builds under the carry limit, and the GPU job's dry run serves it on a mocked CUDA platform.

One build (xz level 1, the largest the bundle gets: the real one uses level 6) and one ``DRY_RUN=1`` run of
``benchmarks/gpu/run_gpu_job.sh`` serve every test here (one module, so pytest-xdist keeps them on one
worker). The dry run unpacks the bundle with the GPU host's Python 3.12 tags, then in subprocesses with the
bundle's vLLM tree first on ``sys.path`` and NVML mocked (``benchmarks/gpu/cuda_mock.py``) imports vLLM as
the CUDA platform, parses every command line the job would run with vLLM's own parsers, builds each
server's engine config and constructs the model on the meta device. Downloads are cached
(``benchmarks/gpu/downloads.py``): the official vLLM wheel is 326 MB and took 4 s here, so CI fetches it
once per machine instead of keeping a copy in the repository.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gpu import build_bundle, downloads, job_plan, shapes, vllm_tree  # noqa: E402

pytestmark = [pytest.mark.model]
MIB = 2**20


@pytest.fixture(scope="module")
def bundle(model_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("gpu-bundle")
    manifest = build_bundle.build(out, model_dir=model_dir, preset=1)
    return out, manifest


@pytest.fixture(scope="module")
def dry_run(bundle, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    root = tmp_path_factory.mktemp("gpu-job")
    out, work = root / "out", root / "work"
    env = {**os.environ, "DRY_RUN": "1", "BUNDLE_DIR": str(bundle[0]), "WORK_DIR": str(work),
           "OUT_DIR": str(out), "PYTHON": sys.executable}
    env.pop("VLLM_TARGET_DEVICE", None)
    done = subprocess.run(["bash", str(REPO / "benchmarks/gpu/run_gpu_job.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    return done, out, work


def preflight(out: Path, role: str) -> dict:
    return json.loads((out / f"preflight-{role}.json").read_text())


def step(out: Path, role: str, name: str) -> dict:
    result = preflight(out, role)["steps"][name]
    assert result["ok"], result.get("traceback", result)
    return result["value"]


def tracked_tree_bytes() -> int:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return sum((REPO / n).stat().st_size for n in names.decode().split("\0") if n and (REPO / n).is_file())


def test_bundle_fits_the_device_tools_64_mib_with_the_working_tree(bundle):
    out, manifest = bundle
    size = build_bundle.bundle_size(out)
    assert manifest["bundle_bytes"] <= size < 64 * MIB
    assert size + tracked_tree_bytes() < 64 * MIB
    assert sorted(p.name for p in out.iterdir()) == [
        "kvevict.tar.xz", "manifest.json", "model.tar.xz", "vllm-tree.tar.xz", "wheels"]
    assert len(manifest["wheels"]) == len(downloads.pinned_requirements())
    assert all(name.endswith(".whl") for name in manifest["wheels"])


def test_a_bundle_over_the_limit_fails_naming_its_parts(model_dir, tmp_path):
    with pytest.raises(build_bundle.BundleTooLarge, match=r"over the 1 MiB limit; parts .*vllm-tree"):
        build_bundle.build(tmp_path / "b", model_dir=model_dir, size_limit=MIB, preset=0)


def test_vllm_tree_is_the_official_wheels_python_without_compiled_files(bundle):
    out, manifest = bundle
    assert manifest["vllm_wheel"].startswith("vllm-0.32.0-") and "cpu" not in manifest["vllm_wheel"]
    with tarfile.open(out / "vllm-tree.tar.xz") as tar:
        names = tar.getnames()
        metadata = tar.extractfile("vllm-0.32.0.dist-info/METADATA").read().decode()
    assert not [n for n in names if n.endswith((".so", ".cu", ".h", ".hpp")) or n.endswith("vllm-rs")]
    assert "vllm-0.32.0.dist-info/RECORD" not in names
    assert "Name: vllm\n" in metadata and "Version: 0.32.0\n" in metadata
    assert manifest["tree_dropped_bytes"] > 600 * MIB  # the .so files, vllm-rs and headers stay behind


def test_model_travels_without_weights(bundle):
    with tarfile.open(bundle[0] / "model.tar.xz") as tar:
        names = set(tar.getnames())
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [n for n in names if n.endswith(build_bundle.WEIGHT_SUFFIXES)]


def test_tree_carries_the_stub_and_the_flash_attention_patch(bundle):
    with tarfile.open(bundle[0] / "vllm-tree.tar.xz") as tar:
        stub = tar.extractfile(vllm_tree.STUB_TARGET).read().decode()
        flash = tar.extractfile(vllm_tree.FLASH_ATTN_INIT).read().decode()
    assert stub == vllm_tree.STUB.read_text()
    assert vllm_tree.FLASH_ATTN_PATCHED in flash and vllm_tree.FLASH_ATTN_RAISE not in flash


def test_patch_refuses_a_vllm_whose_text_moved(tmp_path):
    changed = tmp_path / "__init__.py"
    changed.write_text("if not FA2_AVAILABLE:\n    raise ImportError('x')\n")
    with pytest.raises(RuntimeError, match="no longer matches"):
        vllm_tree.patch_text(changed, vllm_tree.FLASH_ATTN_RAISE, vllm_tree.FLASH_ATTN_PATCHED)


def test_dry_run_passes_its_stages_and_starts_no_server(dry_run):
    """The eviction role's preflight is the backend test's (last in this file)."""
    done, out, _ = dry_run
    assert (out / "summary.md").is_file(), done.stdout[-4000:] + done.stderr[-2000:]
    summary = (out / "summary.md").read_text()
    for stage in ("unpack", "preflight commands", "preflight vanilla"):
        assert f"| {stage} | rc 0 |" in summary, summary
    assert "correctness" not in summary and "bench |" not in summary
    assert not list((out / "logs").glob("correctness-*.log"))


def test_vllm_imports_from_the_bundle_as_the_cuda_platform(dry_run):
    _, out, work = dry_run
    platform = step(out, "vanilla", "platform")
    assert platform["platform"] == "NvmlCudaPlatform"
    assert platform["vllm_version"] == "0.32.0"
    assert platform["vllm_file"] == str(work / "vllm-tree" / "vllm" / "__init__.py")
    assert step(out, "vanilla", "server modules import")


def test_flash_attention_imports_as_unavailable(dry_run):
    assert step(dry_run[1], "vanilla", "flash attention patched") == {
        "imports": True, "fa_version_2_supported": False, "fa_version_3_supported": False}


def test_vanilla_config_resolves_to_triton_attention_without_compiled_ops(dry_run):
    config = step(dry_run[1], "vanilla", "engine config")
    assert config["attention_backend"] == "TRITON_ATTN"
    assert config["custom_ops"] == ["none"] and config["cudagraph_mode"] == "NONE"
    assert config["ir_op_priority"]["rms_norm"][0] == "native"
    assert config["ir_op_priority"]["fused_add_rms_norm"][0] == "native"


def test_model_constructs_with_triton_attention(dry_run):
    model = step(dry_run[1], "vanilla", "model on meta")
    assert model["class"] == "LlamaForCausalLM" and model["parameters"] > 100_000_000
    assert model["attention_impl"] == "vllm.v1.attention.backends.triton_attn.TritonAttentionImpl"


def test_stub_registers_only_ops_vllm_looks_up_and_they_resolve(dry_run):
    result = preflight(dry_run[1], "vanilla")
    assert result["stub_ops"] == vllm_tree.stub_op_names()
    assert {name: result["c_ops_looked_up"].get(name) for name in result["stub_ops"]} == dict.fromkeys(
        result["stub_ops"], True)
    assert step(dry_run[1], "vanilla", "weak_ref_tensor") is True


def test_every_command_line_of_the_job_parses_in_vllm(dry_run):
    out = dry_run[1]
    bench = step(out, "eviction", "command lines commands-bench-smollm2-135m.json")
    assert bench["servers"]["vanilla"]["attention_backend"] == "TRITON_ATTN"
    assert bench["servers"]["eviction"]["kv_eviction"]["method"] == "ada-snapkv"
    assert bench["clients"]["16k-ada-snapkv-0.1"]["extra_body"] == {"vllm_xargs": {"kv_budget": 0.1}}
    assert {c["request_rate"] for c in bench["clients"].values()} == {float("inf")}
    graphs = step(out, "eviction", "command lines commands-bench-graphs.json")
    assert {s["cudagraph_mode"] for s in graphs["servers"].values()} == {"PIECEWISE"}
    correctness = step(out, "eviction", "command lines commands-correctness.json")
    assert correctness["servers"]["eviction"]["kv_eviction"]["budget"] == 0.25
    prefix = step(out, "eviction", "command lines commands-bench-prefix.json")
    assert {c["dataset"] for c in prefix["clients"].values()} == {"prefix_repetition"}
    assert set(prefix["clients"]) == {"vanilla", "ada-snapkv-0.25"}  # one budget: a second would hit
    assert prefix["servers"]["eviction"]["kv_eviction"]["budget"] == 0.25


def test_the_scorer_and_fp8_stages_command_lines_parse_in_vllm(dry_run):
    """Issue 53's learned scorer and issue 51's fp8 cache each get a correctness run and a bench row."""
    out = dry_run[1]
    scorer = step(out, "eviction", "command lines commands-correctness-kvzap.json")
    assert scorer["servers"]["eviction"]["kv_eviction"]["method"] == "kvzap"
    assert scorer["servers"]["vanilla"]["kv_eviction"] is None
    shape_bench = step(out, "eviction", "command lines commands-bench-smollm2-135m.json")  # its bench row
    assert shape_bench["clients"]["8k-ada-kvzap-0.25"]["extra_body"] == {
        "vllm_xargs": {"kv_eviction": "ada-kvzap", "kv_budget": 0.25}}
    for name in ("commands-correctness-fp8.json", "commands-bench-fp8.json"):
        fp8 = step(out, "eviction", f"command lines {name}")
        assert {s["cache_dtype"] for s in fp8["servers"].values()} == {"fp8"}
        assert fp8["servers"]["eviction"]["kv_eviction"]["method"] == "ada-snapkv"


def test_eviction_flags_resolve_to_the_projects_triton_backend(dry_run):
    """``--kv-eviction`` on CUDA: ``CUSTOM``, registered by the plugin as ``backend_cuda``'s backend, whose
    attention is a ``TritonAttentionImpl`` (the model constructs: the FlashAttention backend it replaced
    failed here, "Selected backend CUSTOM is not valid for this configuration. Reason: dtype not
    supported")."""
    done, out, _ = dry_run
    assert "| preflight eviction | rc 0 |" in (out / "summary.md").read_text()
    assert done.returncode == 0, done.stdout[-4000:]
    config = step(out, "eviction", "engine config")
    assert config["attention_backend"] == "CUSTOM"
    assert config["attention_backend_path"].startswith("vllm_kvevict.vllm_adapter.backend_cuda.")
    model = step(out, "eviction", "model on meta")
    assert model["attention_backend"] == "CUSTOM"
    assert model["attention_impl"].startswith("vllm_kvevict.vllm_adapter.backend_cuda.")
    assert model["triton_attention_subclass"] is True


@pytest.mark.parametrize("name", list(shapes.SHAPES))
def test_each_shapes_bench_servers_parse_in_vllm_with_the_pool_sized_from_the_shape(dry_run, name):
    """Issue 70: every shape's config and both servers' flags pass vLLM's own parsers on the CUDA platform,
    on the KV pool and memory share the plan computed from the shape."""
    out = dry_run[1]
    planned = json.loads((out / f"plan-bench-{name}.json").read_text())
    parsed = step(out, "eviction", f"command lines commands-bench-{name}.json")
    shape = shapes.SHAPES[name]
    for role, server in parsed["servers"].items():
        assert server["architecture"] == shape.architecture
        assert server["num_gpu_blocks_override"] == planned["pool_blocks"] == 8 * (8192 + 256) // 16
        assert server["max_model_len"] == 16384 + 256 + 16
        assert server["gpu_memory_utilization"] == planned["memory_share"]
        assert server["attention_backend"] == ("TRITON_ATTN" if role == "vanilla" else "CUSTOM")
    commands = json.loads((out / f"commands-bench-{name}.json").read_text())
    assert all("--no-enable-prefix-caching" in command for command in commands["servers"].values())
    lengths = {c["num_prompts"] for c in parsed["clients"].values()}
    assert lengths == {32, 16}  # 4 waves of vanilla's 8 requests at 8k, of its 4 at 16k


@pytest.mark.parametrize("name", list(shapes.SHAPES))
def test_each_shape_builds_in_vllm_with_the_parameters_of_its_published_model(dry_run, name):
    """vLLM's own model of the written config (on meta, the eviction role's attention) counts the parameters
    the shape's sizes give."""
    model = step(dry_run[1], "eviction", f"model on meta {name}")
    assert model["class"] == shapes.SHAPES[name].architecture
    assert model["parameters"] == shapes.SHAPES[name].parameters()


def test_the_kept_context_row_runs_only_where_a_scorer_ships(dry_run):
    out = dry_run[1]
    for name in shapes.SHAPES:
        planned = json.loads((out / f"plan-bench-{name}.json").read_text())
        labels = {run["label"] for run in planned["runs"]}
        served = name == "smollm2-135m"
        assert (planned["kept_context"]["scorer"] is not None) is served
        assert ("16k-ada-kvzap-0.25" in labels) is served
        assert {"8k-vanilla", "8k-ada-snapkv-0.25", "16k-ada-snapkv-0.1"} <= labels


def test_the_dry_run_is_call_one_and_writes_every_shape(dry_run):
    done, out, work = dry_run
    assert "call: 1" in (out / "summary.md").read_text()
    assert "| shape configs | rc 0 |" in (out / "summary.md").read_text()
    assert sorted(p.name for p in (work / "shapes").iterdir()) == sorted(shapes.SHAPES)
    assert job_plan.CALLS[1][-1] == "bench smollm2-135m+qwen2.5-1.5b"
