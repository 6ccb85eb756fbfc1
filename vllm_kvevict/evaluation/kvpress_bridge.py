"""Run the kvpress side: call ``scripts/kvpress_eval/run_kvpress.py`` in the reference environment on the
same samples file, then score its raw outputs here into ordinary :class:`Result` files."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from vllm_kvevict.evaluation.answer_match import score
from vllm_kvevict.evaluation.configs import EvalConfig
from vllm_kvevict.evaluation.results import Result
from vllm_kvevict.evaluation.sample import Sample

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kvpress_eval" / "run_kvpress.py"
PRESSES = ("snapkv", "pyramidkv", "ada-snapkv", "critical-snapkv", "critical-ada-snapkv", "streamingllm")


def kvpress_configs(
    presses: Sequence[str], budgets: Sequence[float], modes: Sequence[str]
) -> list[EvalConfig]:
    """The HF full-cache baseline plus every press x kept fraction x mode, presses validated."""
    for press in presses:
        if press not in PRESSES:
            raise ValueError(f"unknown kvpress press {press!r}; valid presses: {', '.join(PRESSES)}")
    configs = [EvalConfig("kvpress", "none", 1.0)]
    configs += [EvalConfig("kvpress", p, b, m) for m in modes for p in presses for b in budgets]
    return configs


def run_kvpress(
    python: Path, model_dir: Path, samples_path: Path, raw_dir: Path, configs: Sequence[EvalConfig]
) -> None:
    """Answer the samples with every configuration in the reference environment (skips complete ones)."""
    if not python.is_file():
        raise FileNotFoundError(f"no kvpress reference python at {python}; run `make install-ref`")
    specs = ",".join(f"{c.method}:{c.kept:g}:{c.mode}" for c in configs)
    command = [
        str(python),
        str(SCRIPT),
        "--model-dir",
        str(model_dir),
        "--samples",
        str(samples_path),
        "--output-dir",
        str(raw_dir),
        "--configs",
        specs,
    ]
    subprocess.run(command, check=True)


def score_raw(raw_path: Path, samples: Sequence[Sample]) -> list[Result]:
    """Score a raw kvpress output file against ``samples``; every sample must have an output."""
    by_id = {s.id: s for s in samples}
    results = []
    for line in raw_path.read_text().splitlines():
        record = json.loads(line)
        sample = by_id[record["sample_id"]]
        results.append(
            Result(
                config=record["config"],
                sample_id=sample.id,
                task=sample.task,
                target_tokens=sample.target_tokens,
                prompt_tokens=sample.prompt_tokens,
                served_prompt_tokens=record["prompt_tokens"],
                output=record["output"],
                answers=sample.answers,
                score=score(record["output"], sample.answers, sample.metric),
                latency_s=record["latency_s"],
            )
        )
    if {r.sample_id for r in results} != set(by_id):
        raise ValueError(f"{raw_path} does not answer exactly the current samples")
    return results
