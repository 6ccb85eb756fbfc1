"""The promised command works from .venv: ``vllm serve MODEL --kv-eviction ada-snapkv --kv-budget 1024``.

Also: ``vllm serve --help=KVEviction`` documents the flags, and a bad setting stops start-up with one line.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_kvevict.server_process import VLLMServer, vllm_executable

pytestmark = [pytest.mark.e2e, pytest.mark.model]

NEEDLE_CITY = "Valparaiso"
NEEDLE_NUMBER = "7341"


def run_vllm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [str(vllm_executable()), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def haystack_prompt(tokenizer, num_tokens: int) -> str:
    """Filler prose with one needle in the middle, then the question (about ``num_tokens`` tokens)."""
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    needle = f"The secret number of {NEEDLE_CITY} is {NEEDLE_NUMBER}. "
    question = f"\nWhat is the secret number of {NEEDLE_CITY}? The secret number of {NEEDLE_CITY} is"
    half = filler * (num_tokens // len(tokenizer(filler)["input_ids"]) // 2)
    return half + needle + half + question


BAD_SETTINGS = [
    (("--kv-eviction", "bogus", "--kv-budget", "512"), "invalid choice: 'bogus' (choose from 'snapkv'"),
    (("--kv-eviction", "snapkv", "--kv-budget", "1.5"), "--kv-budget='1.5': a fractional budget"),
    (("--kv-eviction", "snapkv", "--kv-budget", "512", "--kv-eviction-config", '{"windw": 8}'), "windw"),
    (("--kv-budget", "512", "--kv-eviction-config", "configs/missing.yaml"),
     "--kv-eviction-config configs/missing.yaml: no such file"),
]
HELP = ("serve", "--help=KVEviction")


@pytest.fixture(scope="module")
def cli_runs(model_dir) -> dict[tuple[str, ...], subprocess.CompletedProcess[str]]:
    """``vllm serve --help=KVEviction`` and each bad setting, run at once (each imports vLLM: ~15 s)."""
    commands = [HELP, *(("serve", str(model_dir), *args) for args, _ in BAD_SETTINGS)]
    with ThreadPoolExecutor(len(commands)) as pool:
        return dict(zip(commands, pool.map(lambda command: run_vllm(*command), commands), strict=True))


def test_help_documents_the_eviction_flags(cli_runs):
    result = cli_runs[HELP]
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--kv-eviction METHOD", "--kv-budget BUDGET", "--kv-eviction-config JSON|FILE"):
        assert flag in result.stdout
    help_text = " ".join(result.stdout.split())  # argparse wraps long lines
    assert "streamingllm" in help_text and "kept fraction of the prompt" in help_text


@pytest.mark.parametrize(("args", "message"), BAD_SETTINGS)
def test_bad_setting_stops_start_up_with_one_line(cli_runs, model_dir, args, message):
    result = cli_runs[("serve", str(model_dir), *args)]
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("vllm serve: error:"), result.stderr[-2000:]
    assert message in last_line


@pytest.fixture(scope="module")
def documented_server(model_dir):
    # Exactly the documented flags; no --enforce-eager, prefix-caching or chunked-prefill flags given: the
    # plugin's guard rails say what they keep (compiled model, prefix caching, chunked prefill), and the
    # needle below is found by the compiled server.
    with VLLMServer(
        model_dir,
        extra_args=("--kv-eviction", "ada-snapkv", "--kv-budget", "1024"),
        enforce_eager=False,
        startup_timeout_s=1500,  # torch.compile's warm-up on two busy cores
    ) as server:
        yield server


def test_start_up_states_every_guard_rail_and_the_capacity_gain(documented_server):
    log = documented_server.log_path.read_text()
    assert "kv-eviction: method=ada-snapkv budget=1024 tokens per KV head" in log
    assert "prefix caching stays on; a request evicting its whole prompt reads cached blocks" in log
    # vLLM's chunked prefill stays on; the default evicts a prompt once, after its last chunk
    assert "prefill=whole (one eviction after the prompt's last chunk)" in log
    assert "chunked prefill turned off" not in log
    assert "the model runs compiled; attention (a splitting op) evicts between the pieces" in log
    assert "enforce_eager on" not in log
    capacity = r"kv-eviction active: .* holds \d+ of \d+ blocks after prefill \(about [\d.]+x more"
    assert re.search(capacity, log)


def test_documented_server_finds_a_needle_in_an_evicted_prompt(documented_server, model_dir):
    from openai import OpenAI
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = haystack_prompt(tokenizer, 2000)
    assert len(tokenizer(prompt)["input_ids"]) > 1024 + 2 * 128  # long enough that blocks are freed
    client = OpenAI(base_url=documented_server.base_url, api_key="unused", timeout=600, max_retries=0)
    answer = client.completions.create(
        model=documented_server.served_model_name, prompt=prompt, max_tokens=8, temperature=0
    ).choices[0].text
    assert NEEDLE_NUMBER in answer
    assert documented_server.metric_value("vllm_kvevict_requests_compacted_total") >= 1
    assert documented_server.metric_value("vllm_kvevict_blocks_freed_total") >= 1
