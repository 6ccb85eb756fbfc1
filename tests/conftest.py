"""Shared fixtures: the prepared bundled model. Nothing else global, so that unit tests stay fast."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """Directory of the converted, verified SmolLM2-135M-Instruct (converted on first use, then instant)."""
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    return prepared_model_dir()
