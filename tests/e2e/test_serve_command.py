"""The documented ``vllm serve MODEL_DIR`` from ``.venv`` serves the bundled model over the OpenAI API.

One server for the module (vanilla vLLM until the eviction adapter adds ``--kv-eviction``), started through
:class:`VLLMServer`, which every other end-to-end test uses too.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from vllm_kvevict.cli.model_catalog import SMOLLM2
from vllm_kvevict.server_process import ServerStartError, VLLMServer, free_port, vllm_executable

QUESTION = SMOLLM2.verify_question  # the one prepare-model verified with HF transformers; clear margin


@pytest.fixture(scope="module")
def server(model_dir):
    with VLLMServer(model_dir, startup_timeout_s=600) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="unused", timeout=120)


# -- launcher, no server needed ---------------------------------------------------------------------------
def test_vllm_executable_is_the_one_of_this_environment():
    assert vllm_executable() == Path(sys.executable).parent / "vllm"
    assert os.access(vllm_executable(), os.X_OK)


@pytest.mark.model
def test_launcher_sets_cpu_env_and_builds_the_serve_command(model_dir):
    launcher = VLLMServer(model_dir, extra_args=["--max-model-len", "2048"], env={"EXTRA": "1"},
                          kv_cache_space_gib=2, port=free_port())
    assert launcher.env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert launcher.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert launcher.env["EXTRA"] == "1"
    assert launcher.command[1:3] == ["serve", str(model_dir)]
    assert launcher.command[-3:] == ["--enforce-eager", "--max-model-len", "2048"]
    assert launcher.base_url == f"http://127.0.0.1:{launcher.port}/v1"


@pytest.mark.model
def test_launcher_can_leave_compilation_on(model_dir):
    launcher = VLLMServer(model_dir, enforce_eager=False, port=free_port())
    assert "--enforce-eager" not in launcher.command


@pytest.mark.model
@pytest.mark.parametrize("reserved", ["--port", "--host=0.0.0.0", "--served-model-name"])
def test_launcher_rejects_args_it_sets_itself(model_dir, reserved):
    with pytest.raises(ValueError, match=reserved.split("=")[0]):
        VLLMServer(model_dir, extra_args=[reserved, "x"])


@pytest.mark.model
def test_launcher_rejects_non_model_dir_and_bad_kv_space(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        VLLMServer(tmp_path)
    with pytest.raises(ValueError, match="kv_cache_space_gib must be > 0 GiB, got 0"):
        VLLMServer(model_dir, kv_cache_space_gib=0)


@pytest.mark.e2e
def test_server_that_dies_at_startup_fails_with_its_log_tail(model_dir):
    with socket.socket() as holder:  # an explicit port that is taken: vLLM exits, no retry on another port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        launcher = VLLMServer(model_dir, port=holder.getsockname()[1], startup_timeout_s=300)
        with pytest.raises(ServerStartError, match="(?s)exited with code 1 .*Address already in use"):
            launcher.start()
    assert not launcher.is_running()


# -- the served model ---------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_models_endpoint_lists_the_served_name(client, server):
    assert [model.id for model in client.models.list().data] == [server.served_model_name]


@pytest.mark.e2e
def test_chat_completion_answers_greedily(client, server):
    response = client.chat.completions.create(
        model=server.served_model_name, messages=[{"role": "user", "content": QUESTION}],
        temperature=0, max_tokens=24,
    )
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].finish_reason == "stop"  # <|im_end|> is the eos vLLM stops on


@pytest.mark.e2e
def test_completion_answers_a_raw_chatml_prompt(client, server):
    prompt = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    response = client.completions.create(model=server.served_model_name, prompt=prompt, temperature=0,
                                         max_tokens=24, extra_body={"return_token_ids": True})
    assert "Paris" in response.choices[0].text
    # <|im_start|> (id 1) is also the BOS: a prepended BOS would show as [1, 1, ...]; 4093 is "user".
    assert response.choices[0].model_extra["prompt_token_ids"][:2] == [1, 4093]


@pytest.mark.e2e
def test_metrics_expose_kv_cache_usage(server):
    assert 0.0 <= server.metric_value("vllm:kv_cache_usage_perc") <= 1.0
    assert "vllm:kv_cache_usage_perc" in server.metrics_text()


@pytest.mark.e2e
def test_stop_leaves_no_process_behind(server):
    group = server.pid
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{server.root_url}/health", timeout=5)
