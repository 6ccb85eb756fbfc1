"""Two rows of the model matrix (``benchmarks/model_matrix``, issue 29) through real servers: a tiny
random-weight Llama with 4 query heads per KV head and head size 128 serves with eviction, and a Gemma-2
with sliding-window layers is refused at start-up with one line. The full matrix and its table:
``docs/usage.md`` ("Models eviction serves").
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

from vllm_kvevict.server_process import ServerStartError, VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MATRIX_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "model_matrix"
PROMPT_TOKENS = 600
MAX_TOKENS = 12
SERVER_ARGS = (
    "--max-model-len",
    "1024",
    "--block-size",
    "32",
    "--max-num-seqs",
    "4",
    "--kv-eviction",
    "snapkv",
    "--kv-budget",
    "64",
)


def matrix_models():
    spec = importlib.util.spec_from_file_location("model_matrix_models", MATRIX_DIR / "models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    models = matrix_models()
    out = tmp_path_factory.mktemp("model-matrix")
    chosen = {model.name: model for model in models.MODELS if model.name in ("llama-gqa4-hd128", "gemma2")}
    return {name: models.build(model, model_dir, out) for name, model in chosen.items()}


def complete(server: VLLMServer, prompt: list[int], **extra) -> list[int]:
    body = {
        "model": server.served_model_name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    response = httpx.post(server.base_url + "/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text[:500]
    return response.json()["choices"][0]["token_ids"]


def test_a_gqa_llama_with_head_size_128_serves_with_eviction(built, tmp_path):
    prompt = [(7 * index) % 40000 + 100 for index in range(PROMPT_TOKENS)]
    model, log = built["llama-gqa4-hd128"], tmp_path / "server.log"
    with VLLMServer(model, extra_args=SERVER_ARGS, served_model_name="matrix", log_path=log) as server:
        # Each with its own cache salt: a request finding another's published blocks keeps them whole.
        # vLLM's own path, then a budget >= the prompt:
        whole = complete(server, prompt, vllm_xargs={"kv_eviction": "none"}, cache_salt="a")
        covering = complete(server, prompt, vllm_xargs={"kv_budget": 1024}, cache_salt="b")
        freed_before = server.metric_value("vllm_kvevict_blocks_freed_total")
        compacted = complete(server, prompt, cache_salt="c")  # 64 tokens per KV head
        freed = server.metric_value("vllm_kvevict_blocks_freed_total") - freed_before
        assert server.wait_for_metric("vllm:kv_cache_usage_perc", 0.0, 60) == 0
        assert httpx.get(server.root_url + "/health", timeout=30).status_code == 200
    assert covering == whole
    assert len(compacted) == MAX_TOKENS
    # 600 tokens in 32-token blocks (19), kept to 64 tokens per KV head rounded so that whole blocks are freed
    # (88): the accounting rule frees (600 - 88) / 32 - 1 = 15 leading blocks.
    assert freed == 15


def test_a_model_with_sliding_window_layers_is_refused_at_start_up_in_one_line(built):
    server = VLLMServer(built["gemma2"], extra_args=SERVER_ARGS, served_model_name="matrix")
    with pytest.raises(ServerStartError) as failure:
        server.start()
    server.stop()
    log = str(failure.value) + server.log_tail(max_lines=2000)
    refusals = {
        line[line.index("kv eviction refused") :]
        for line in log.splitlines()
        if "kv eviction refused" in line
    }
    assert refusals, log[-3000:]
    assert all("sliding-window" in line and "Gemma2ForCausalLM" in line for line in refusals)
