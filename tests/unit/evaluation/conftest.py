"""Fixtures of the evaluation tests: the bundled model's prompt format (tokenizer + chat template)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvevict.evaluation.prompt_format import PromptFormat


@pytest.fixture(scope="session")
def prompt_format(model_dir: Path) -> PromptFormat:
    return PromptFormat.from_path(model_dir)
