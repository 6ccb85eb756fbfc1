"""The one real ``vllm serve`` with eviction and a small KV pool that the reliability tests share (issue 13).

Settings and helpers: ``reliability_traffic.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability_traffic import INJECTED_FAULTS, SERVER_ARGS

from vllm_kvevict.datapath.policy_guard import FAULT_INJECTION_ENV
from vllm_kvevict.server_process import VLLMServer


@pytest.fixture(scope="session")
def server(model_dir: Path) -> Iterator[VLLMServer]:
    env = {FAULT_INJECTION_ENV: json.dumps(INJECTED_FAULTS)}
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, env=env) as launched:
        yield launched


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
