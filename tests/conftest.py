"""Shared fixtures: the prepared bundled model. Nothing else global, so that unit tests stay fast.

Every server a test starts goes through ``vllm_kvevict.cli.server_process.VLLMServer``, which applies
``vllm_kvevict.cpu_setup`` (``--dtype`` from the CPU's capabilities, tcmalloc when present) and logs the
choice in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """Directory of the converted, verified SmolLM2-135M-Instruct (converted on first use, then instant)."""
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    return prepared_model_dir()
