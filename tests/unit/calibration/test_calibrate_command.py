"""``vllm-kvevict calibrate`` end to end on a tiny random Llama and a tiny corpus: the written scorers load
back through ``SurrogateScorer.load`` for that model and score each head alone (the default ``--heads
separate``), ``--heads joint`` writes scorers that read every head; models it cannot calibrate are refused
in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, GPT2Config

from vllm_kvevict.cli.main import main
from vllm_kvevict.policies.surrogate_scorer import SurrogateScorer, model_fingerprint, scores_each_head_alone

pytestmark = pytest.mark.model

TINY_RUN = ["--contexts", "3", "--held-out", "1", "--min-tokens", "24", "--max-tokens", "40"]


@pytest.fixture(scope="module")
def calibrated(tiny_model_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scorers")
    assert main(["calibrate", str(tiny_model_dir), "--out", str(out), *TINY_RUN, "--epochs", "1"]) == 0
    return out


def test_both_scorers_load_for_the_calibrated_model(calibrated: Path, tiny_model_dir: Path) -> None:
    fingerprint = model_fingerprint(AutoConfig.from_pretrained(str(tiny_model_dir)))
    for kind in ("linear", "mlp"):
        scorer = SurrogateScorer.load(calibrated / kind)
        assert scorer.spec.kind == kind
        assert scorer.mismatch(fingerprint) is None
        assert (scorer.spec.num_layers, scorer.spec.num_kv_heads, scorer.spec.head_dim) == (2, 2, 8)
        keys, values = torch.randn(2, 7, 8), torch.randn(2, 7, 8)
        scores = scorer.layer_scores(1, keys, values)
        assert scores.shape == (2, 7) and bool(torch.isfinite(scores).all())
        fit = scorer.spec.fit
        assert fit["train_contexts"] == 2 and fit["held_out_contexts"] == 1
        assert set(fit["held_out"]) == {"r2", "top25"}
        assert fit["heads"] == "separate" and scores_each_head_alone(scorer)  # the default: per-chunk ready


def test_the_report_holds_every_feature_set_and_the_comparison_points(calibrated: Path, capsys) -> None:
    report = json.loads((calibrated / "fit.json").read_text())
    assert set(report["table"]) == {
        *(f"{features} ({heads})" for features in ("kv-pair-norms", "kv-log-norms") for heads in HEADS),
        "hidden-states (KVzap input)",
        KEY_NORM,
    }
    assert report["heads"] == "separate"
    for kinds in report["table"].values():
        for fit in kinds.values():
            assert 0.0 <= fit["top25"] <= 1.0
    assert report["contexts"] == 3 and 3 * 24 <= report["tokens"] <= 3 * 40


KEY_NORM = "key norm (KNorm rule)"
HEADS = ("separate", "joint")


def test_a_model_of_another_architecture_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    GPT2Config(n_layer=1, n_head=2, n_embd=8, architectures=["GPT2LMHeadModel"]).save_pretrained(
        str(tmp_path)
    )
    assert main(["calibrate", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err
    assert not (tmp_path / "out").exists()


def test_an_unknown_feature_set_is_refused_naming_the_valid_ones(
    tiny_model_dir: Path, tmp_path, capsys
) -> None:
    assert main(["calibrate", str(tiny_model_dir), "--out", str(tmp_path), "--features", "queries"]) == 2
    err = capsys.readouterr().err
    assert "'queries'" in err and "kv-pair-norms" in err


def test_heads_joint_writes_scorers_that_read_every_head(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ["calibrate", str(tiny_model_dir), "--out", str(tmp_path), *TINY_RUN, "--epochs", "1"]
    assert main([*args, "--heads", "joint", "--no-compare"]) == 0
    report = json.loads((tmp_path / "fit.json").read_text())
    assert set(report["table"]) == {"kv-pair-norms (joint)", KEY_NORM}
    for kind in ("linear", "mlp"):
        scorer = SurrogateScorer.load(tmp_path / kind)
        assert scorer.spec.fit["heads"] == "joint" and not scores_each_head_alone(scorer)
