"""The kvpress side (``scripts/kvpress_eval/run_kvpress.py`` in ``.venv-ref``) on one short real sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_kvevict.evaluation.generate import generate_sample
from vllm_kvevict.evaluation.kvpress_bridge import SCRIPT, score_raw
from vllm_kvevict.evaluation.prompt_format import PromptFormat
from vllm_kvevict.evaluation.sample import write_samples
from vllm_kvevict.evaluation.tasks import get_task

pytestmark = [pytest.mark.reference, pytest.mark.model]

REFERENCE_PYTHON = Path(__file__).resolve().parents[3] / ".venv-ref" / "bin" / "python"


def test_kvpress_script_answers_with_full_cache_and_compresses_to_the_kept_fraction(
    prompt_format: PromptFormat, model_dir: Path, tmp_path: Path
):
    import subprocess

    assert REFERENCE_PYTHON.is_file(), "run `make install-ref` to create .venv-ref"
    sample = generate_sample(get_task("niah_single_noise"), prompt_format, 400, seed=0, index=0)
    samples_path = tmp_path / "samples.jsonl"
    write_samples(samples_path, [sample])
    # PyramidKV at 0.5 of ~400 tokens is a real pyramid (layers of different lengths): the question must
    # still run on it in agnostic mode.
    configs = "none:1:aware,snapkv:0.5:aware,snapkv:0.5:agnostic,pyramidkv:0.5:agnostic"
    subprocess.run(
        [
            str(REFERENCE_PYTHON),
            str(SCRIPT),
            "--model-dir",
            str(model_dir),
            "--samples",
            str(samples_path),
            "--output-dir",
            str(tmp_path),
            "--configs",
            configs,
        ],
        check=True,
    )

    full = tmp_path / "kvpress-none-aware-1.raw.jsonl"
    assert score_raw(full, [sample])[0].score == 1.0
    aware = json.loads((tmp_path / "kvpress-snapkv-aware-0.5.raw.jsonl").read_text())
    agnostic = json.loads((tmp_path / "kvpress-snapkv-agnostic-0.5.raw.jsonl").read_text())
    assert aware["prompt_tokens"] == sample.prompt_tokens
    assert aware["kept_tokens"] == int(sample.prompt_tokens * 0.5)
    assert agnostic["kept_tokens"] == int(sample.context_tokens * 0.5)
    pyramid = json.loads((tmp_path / "kvpress-pyramidkv-agnostic-0.5.raw.jsonl").read_text())
    assert pyramid["kept_tokens"] > int(sample.context_tokens * 0.5)  # layer 0 keeps more than the mean
    assert pyramid["output"]


def test_kvpress_script_rejects_an_unknown_press_naming_the_valid_ones(tmp_path: Path):
    import subprocess

    completed = subprocess.run(
        [
            str(REFERENCE_PYTHON),
            str(SCRIPT),
            "--model-dir",
            str(tmp_path),
            "--samples",
            str(tmp_path / "s"),
            "--output-dir",
            str(tmp_path),
            "--configs",
            "h2o:0.5:aware",
        ],
        capture_output=True,
        text=True,
    )
    assert completed.returncode != 0
    assert "unknown press 'h2o'; valid presses: none, snapkv" in completed.stderr
