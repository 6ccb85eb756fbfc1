"""The GPU job's model shapes (issue 70) as units: configs, the KV pool and memory share sized from the shape,
the limits, the bench's runs and the job's split into device calls. No server: an 8B model cannot run here."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gpu import bench_shapes, job_plan, shapes  # noqa: E402

GIB = 2**30
LLAMA, QWEN, SMOL = (shapes.SHAPES[n] for n in ("llama-3.1-8b", "qwen2.5-1.5b", "smollm2-135m"))


def tokenizer_dir(tmp_path: Path, ids: int) -> Path:
    """A folder with a BPE ``tokenizer.json`` of ``ids`` ids and a config naming its special tokens."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    vocab = {f"t{i}": i for i in range(ids - 1)}
    data = {"model": {"type": "BPE", "vocab": vocab, "merges": []},
            "added_tokens": [{"id": ids - 1, "content": "<|end|>", "special": True}]}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_parameter_counts_are_the_published_models():
    assert LLAMA.parameters() == 8_030_261_248
    assert QWEN.parameters() == 1_543_714_304
    assert SMOL.parameters() == 134_515_008


def test_kv_bytes_per_token_is_two_layers_kv_heads_head_dim_dtype():
    assert LLAMA.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131_072
    assert QWEN.kv_bytes_per_token() == 2 * 28 * 2 * 128 * 2
    assert SMOL.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2
    assert LLAMA.kv_bytes_per_token(dtype_bytes=1) == 65_536  # an fp8 cache


def test_written_folder_has_the_shapes_config_the_stand_in_tokenizer_and_no_weights(tmp_path):
    folder = shapes.write_model_dir(LLAMA, tokenizer_dir(tmp_path, 300), tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    heads = (config["num_attention_heads"], config["num_key_value_heads"])
    assert config["num_hidden_layers"] == 32 and heads == (32, 8)
    assert (config["head_dim"], config["hidden_size"], config["intermediate_size"]) == (128, 4096, 14336)
    assert config["vocab_size"] == 128256 and config["tie_word_embeddings"] is False
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert config["rope_parameters"]["rope_theta"] == 500000.0
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # the tokenizer's, not Llama's
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", shapes.SHAPE_FILE, "tokenizer.json", "tokenizer_config.json"]
    assert shapes.shape_of(folder) == LLAMA


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
    small = dataclasses.replace(SMOL, vocab_size=299)
    with pytest.raises(ValueError, match="vocab_size 299 is smaller than the tokenizer's 300 ids"):
        shapes.write_model_dir(small, tokenizer_dir(tmp_path, 300), tmp_path / "small")


@pytest.mark.model
def test_written_configs_load_in_transformers_and_the_bundled_shape_is_the_bundled_model(model_dir, tmp_path):
    from transformers import AutoConfig

    bundled = json.loads((model_dir / "config.json").read_text())
    for shape in shapes.SHAPES.values():
        folder = shapes.write_model_dir(shape, model_dir, tmp_path / shape.name)
        config = AutoConfig.from_pretrained(str(folder))
        assert config.architectures == [shape.architecture]
        assert config.num_key_value_heads == shape.num_kv_heads and config.vocab_size == shape.vocab_size
        assert config.vocab_size >= shapes.tokenizer_size(model_dir)
    written = json.loads((tmp_path / "smollm2-135m" / "config.json").read_text())
    def same(a, b):  # the bundled config's floats went through float32 (rms_norm_eps 9.9999997e-06)
        return a == pytest.approx(b, rel=1e-6) if isinstance(b, float) else a == b

    differing = {k for k in bundled if k in written and not same(written[k], bundled[k])}
    assert differing == {"max_position_embeddings"}  # raised for 16k prompts, the note says so
    assert "max_position_embeddings" in SMOL.note


def test_packaged_scorer_is_found_for_the_bundled_shape_only(tmp_path):
    tokenizer = tokenizer_dir(tmp_path, 300)
    found = {name: bench_shapes.kept_context(shapes.write_model_dir(s, tokenizer, tmp_path / name))
             for name, s in shapes.SHAPES.items()}
    assert {c["method"] for c in found.values()} == {"ada-kvzap"}  # learned_methods.KEPT_CONTEXT_AS
    assert found["smollm2-135m"]["scorer"].startswith("smollm2-135m-instruct")
    assert found["qwen2.5-1.5b"]["scorer"] is None and found["llama-3.1-8b"]["scorer"] is None


def test_pool_holds_eight_vanilla_requests_of_the_shortest_workload():
    pool = shapes.pool_blocks(8192, 256)
    assert pool == 8 * 528
    assert shapes.vanilla_requests(pool, 8192, 256) == 8
    assert shapes.vanilla_requests(pool, 16384, 256) == 4
    assert shapes.pool_bytes(LLAMA, pool) == pool * 16 * 131_072


def test_memory_share_covers_weights_pool_and_activations_and_two_servers_fit_an_h100():
    pool, max_len, h100 = shapes.pool_blocks(8192, 256), 16656, int(79.1 * GIB)
    share = shapes.memory_share(LLAMA, pool, max_len, h100)
    need = LLAMA.weight_bytes() + shapes.pool_bytes(LLAMA, pool) + shapes.activation_bytes(LLAMA, max_len)
    assert share * h100 >= need + shapes.FIXED_OVERHEAD_BYTES
    assert 2 * share <= shapes.TWO_SERVERS_SHARE
    assert shapes.memory_share(SMOL, pool, max_len, h100) < 0.1


def test_two_8b_servers_are_refused_on_a_gpu_too_small_for_them():
    with pytest.raises(shapes.ShapeDoesNotFit, match=r"llama-3.1-8b: one server needs .* GiB \(weights 15.0"):
        shapes.memory_share(LLAMA, shapes.pool_blocks(8192, 256), 16656, 40 * GIB)


def test_capacity_limit_is_prompt_plus_output_over_kept_plus_output():
    assert shapes.capacity_limit(8192, 256, 0.25) == pytest.approx((8192 + 256) / (2048 + 256))
    assert shapes.capacity_limit(16384, 256, 0.1) == pytest.approx(16640 / 1894.4)
    assert shapes.capacity_limit(1000, 0, 1.0) == 1.0


def test_decode_limit_reads_weights_once_and_each_requests_kv():
    weights, per_token = LLAMA.weight_bytes(), LLAMA.kv_bytes_per_token()
    expected = (weights + 8 * (2048 + 128) * per_token) / (weights + 8 * (8192 + 128) * per_token)
    assert shapes.decode_limit(LLAMA, 8192, 256, 0.25, 8) == pytest.approx(expected)
    # the small model's weights are a sliver of its KV reads: its limit nears the kept share
    assert shapes.decode_limit(SMOL, 16384, 256, 0.1, 4) < shapes.decode_limit(LLAMA, 16384, 256, 0.1, 4)


def test_bench_plan_runs_both_lengths_each_budget_and_the_kept_context_where_served(tmp_path):
    tokenizer = tokenizer_dir(tmp_path, 300)
    folder = shapes.write_model_dir(SMOL, tokenizer, tmp_path / "smol")
    planned = bench_shapes.plan(SMOL, folder, (8192, 16384), 256, int(79.1 * GIB))
    by_label = {run["label"]: run for run in planned["runs"]}
    rows = ("vanilla", "ada-snapkv-0.25", "ada-snapkv-0.1", "ada-kvzap-0.25")
    assert list(by_label) == [f"{length}-{row}" for length in ("8k", "16k") for row in rows]
    assert by_label["8k-ada-snapkv-0.25"]["xargs"] is None  # the server's budget
    assert by_label["16k-ada-snapkv-0.1"]["xargs"] == {"kv_budget": 0.1}
    assert by_label["8k-ada-kvzap-0.25"]["xargs"] == {"kv_eviction": "ada-kvzap", "kv_budget": 0.25}
    assert by_label["16k-vanilla"]["num_prompts"] == 16 and by_label["8k-vanilla"]["num_prompts"] == 32
    qwen_dir = shapes.write_model_dir(QWEN, tokenizer, tmp_path / "q")
    qwen = bench_shapes.plan(QWEN, qwen_dir, (8192, 16384), 256, int(79.1 * GIB))
    assert [r["label"] for r in qwen["runs"] if "kvzap" in r["label"]] == []


def test_rows_carry_limits_and_ratios_compare_with_vanilla_of_the_same_length():
    run = {"prompt_len": 8192, "num_prompts": 32, "budget": 0.25, "vanilla_requests": 8}
    measured = {"output_throughput": 300.0, "median_ttft_ms": 900.0, "median_tpot_ms": 30.0,
                "max_running": 29, "max_kv_usage": 0.5}
    row = bench_shapes.with_limits({"label": "8k-ada-snapkv-0.25", **measured}, run, LLAMA, 256, 8 * GIB)
    assert row["peak_kv_gib"] == 4.0 and row["capacity_limit"] == 3.67
    vanilla = {"label": "8k-vanilla", "output_throughput": 100.0, "median_ttft_ms": 3000.0,
               "median_tpot_ms": 25.0, "max_running": 8, "max_kv_usage": 1.0}
    base = bench_shapes.with_limits(vanilla, {**run, "budget": None}, LLAMA, 256, 8 * GIB)
    other = {**row, "label": "16k-ada-snapkv-0.25", "prompt_len": 16384}  # no 16k vanilla: no ratio
    [ratio] = bench_shapes.ratios([base, row, other])
    assert ratio["output_tok_s"] == 3.0 and ratio["max_running"] == 29 / 8 and ratio["tpot_p50"] == 1.2
    assert "capacity_limit" not in base


def script_stages() -> set[str]:
    text = (REPO / "benchmarks/gpu/run_gpu_job.sh").read_text()
    found = re.findall(r'^\s*stage (?:"([^"$]+)"|([a-z0-9]+)) ', text, flags=re.M)
    named = {quoted or bare for quoted, bare in found}
    if 'stage "bench ${group// /+}"' in text:
        named |= {job_plan.bench_stage(group) for group in job_plan.BENCH_GROUPS}
    return named


def test_every_stage_of_the_plan_is_a_stage_of_the_job_with_a_limit():
    stages = script_stages()
    planned = {name for call in job_plan.CALLS for name in job_plan.call_stages(call)}
    assert planned <= stages
    assert stages <= set(job_plan.STAGES)  # the script reads every stage's limit from the plan


def test_each_call_fits_the_device_tools_limit_and_the_first_two_a_session():
    for call in job_plan.CALLS:
        assert job_plan.call_seconds(call) * 1.1 <= job_plan.CALL_LIMIT_S - job_plan.CALL_MARGIN_S, call
    first_two = job_plan.call_seconds(1) + job_plan.call_seconds(2) - job_plan.STAGES["unpack"].estimate_s
    assert job_plan.MACHINE_START_S + first_two <= job_plan.SESSION_S + 60  # estimates, never measured


def test_shell_plan_selects_the_calls_stages_under_the_device_tools_limit():
    text = subprocess.run([sys.executable, "-m", "benchmarks.gpu.job_plan", "shell", "--call", "2"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout
    only = re.search(r"^ONLY='(.*)'$", text, flags=re.M).group(1)
    deadline = int(re.search(r"^DEADLINE_S=(\d+)$", text, flags=re.M).group(1))
    assert re.search(only, "bench llama-3.1-8b") and not re.search(only, "correctness")
    assert not re.search(only, "bench smollm2-135m+qwen2.5-1.5b")
    assert deadline <= job_plan.CALL_LIMIT_S - job_plan.CALL_MARGIN_S
    assert "['bench llama-3.1-8b']=" in text
    assert "BENCH_GROUPS=('smollm2-135m qwen2.5-1.5b' 'llama-3.1-8b')" in text


def test_every_shape_is_benched_once_and_each_groups_servers_fit_the_gpu_together():
    grouped = [name for group in job_plan.BENCH_GROUPS for name in group]
    assert sorted(grouped) == sorted(shapes.SHAPES)
    pool, max_len, h100 = shapes.pool_blocks(8192, 256), 16656, int(79.1 * GIB)
    for group in job_plan.BENCH_GROUPS:
        shares = [2 * shapes.memory_share(shapes.SHAPES[n], pool, max_len, h100) for n in group]
        assert sum(shares) <= shapes.TWO_SERVERS_SHARE, group


class AnsweringServer:
    """An HTTP server on a free port whose ``/v1/completions`` answers ``status`` with ``body``."""

    def __init__(self, status: int, body: str) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the stdlib's name
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(status)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        self.served_model_name = "Llama-3.1-8B-shape"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.mark.parametrize(("status", "expected"), [(400, "HTTP 400: no learned scorer ships"), (200, None)])
def test_the_kept_context_probe_records_the_servers_refusal_or_none_when_served(status, expected):
    body = "no learned scorer ships for Llama-3.1-8B-shape" if status == 400 else "{}"
    server = AnsweringServer(status, body)
    try:
        answer = bench_shapes.refusal(server, {"kv_eviction": "ada-kvzap", "kv_budget": 0.25})
    finally:
        server.httpd.shutdown()
    assert (answer is None) if expected is None else answer.startswith(expected)


def test_the_shapes_table_names_the_shape_gpu_pool_rows_ratios_and_limits(tmp_path):
    folder = shapes.write_model_dir(QWEN, tokenizer_dir(tmp_path, 300), tmp_path / "q")
    planned = bench_shapes.plan(QWEN, folder, (8192,), 256, int(79.1 * GIB))
    run = planned["runs"][1]
    row = bench_shapes.with_limits({"label": run["label"], "output_throughput": 200.0, "median_ttft_ms": 1.0,
                                    "median_tpot_ms": 2.0, "max_running": 24, "max_kv_usage": 0.9}, run, QWEN,
                                   256, planned["pool_bytes"])
    base = bench_shapes.with_limits({"label": "8k-vanilla", "output_throughput": 100.0, "median_ttft_ms": 1.0,
                                     "median_tpot_ms": 1.0, "max_running": 8, "max_kv_usage": 1.0},
                                    planned["runs"][0], QWEN, 256, planned["pool_bytes"])
    result = {"shape": {**dataclasses.asdict(QWEN), "parameters": QWEN.parameters()}, "gpu": "NVIDIA H100",
              "output_len": 256, "plan": planned, "rows": [base, row],
              "kept_context_refusal": "HTTP 400: none"}
    result["ratios"] = bench_shapes.ratios(result["rows"])
    text = bench_shapes.markdown(result)
    assert "`qwen2.5-1.5b` (1.54 B parameters" in text and "GPU: NVIDIA H100" in text
    assert "pool 4224 blocks x 16 = 1.80 GiB (28672 B per token)" in text
    assert "| 8k-ada-snapkv-0.25 | 2.00x | 3.00x (3.67x) | 1.00x | 2.00x (0.718x) |" in text
    assert "ada-kvzap (the kept-context default) not run" in text and "HTTP 400: none" in text


def test_a_length_not_in_whole_k_is_labelled_in_tokens(tmp_path):
    folder = shapes.write_model_dir(QWEN, tokenizer_dir(tmp_path, 300), tmp_path / "q")
    planned = bench_shapes.plan(QWEN, folder, (512, 2048), 16, int(79.1 * GIB))
    assert [r["label"] for r in planned["runs"] if r["server"] == "vanilla"] == ["512-vanilla", "2k-vanilla"]
