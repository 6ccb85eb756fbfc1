"""``vllm-kvevict eval`` against a real vanilla vLLM server: one task, one short length, two samples."""

from __future__ import annotations

import json

import pytest

from vllm_kvevict.cli.main import main
from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]


@pytest.fixture(scope="module")
def server(model_dir):
    with VLLMServer(model_dir, kv_cache_space_gib=1, startup_timeout_s=600) as running:
        yield running


def test_eval_answers_scores_and_summarises_against_a_real_server(server, model_dir, tmp_path, capsys):
    output = tmp_path / "results.jsonl"
    code = main(
        [
            "eval",
            "--base-url",
            server.base_url,
            "--tasks",
            "niah_single_noise",
            "--lengths",
            "1k",
            "--samples",
            "2",
            "--concurrency",
            "2",
            "--tokenizer",
            str(model_dir),
            "--output",
            str(output),
            "--no-progress",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["sample_id"] for r in records] == ["niah_single_noise-1024-0", "niah_single_noise-1024-1"]
    for record in records:
        assert record["error"] is None
        assert record["config"] == server.served_model_name
        assert record["served_prompt_tokens"] == record["prompt_tokens"]
        assert 1024 - 8 <= record["prompt_tokens"] <= 1024
        assert record["output"].strip()
    # The bundled model finds a single needle at 1k tokens with the full cache (both samples, measured).
    assert sum(r["score"] for r in records) / len(records) >= 0.5
    assert "| niah_single_noise |" in capsys.readouterr().out


def test_eval_rejects_an_unknown_task_naming_the_valid_ones(capsys):
    assert main(["eval", "--base-url", "http://127.0.0.1:9/v1", "--tasks", "niah"]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'niah'" in err and "niah_single_noise" in err


def test_eval_rejects_a_bad_length_naming_it(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--base-url", "http://127.0.0.1:9/v1", "--lengths", "1k,lots"])
    assert "bad length 'lots'" in capsys.readouterr().err
