"""The ``kv-log-norms`` feature set and float16 scorer files (added to ``policies/surrogate_scorer.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_kvevict.policies.surrogate_scorer import (
    FEATURE_SETS,
    ScorerSpec,
    SurrogateScorer,
    kv_log_norm_features,
)

FINGERPRINT = {
    "architecture": "LlamaForCausalLM",
    "num_hidden_layers": 1,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_size": 32,
    "vocab_size": 100,
}


def rotated(keys: torch.Tensor, angle: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    half = rotary_dim // 2
    x, y = keys[..., :half], keys[..., half:rotary_dim]
    return torch.cat(
        [x * angle.cos() - y * angle.sin(), y * angle.cos() + x * angle.sin(), keys[..., rotary_dim:]], -1
    )


def test_log_norm_features_are_rotation_invariant_and_laid_out_per_head() -> None:
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    angle = torch.rand(5, 2, generator=g) * 6.0
    features = kv_log_norm_features(keys, values, rotary_dim=4)
    torch.testing.assert_close(features, kv_log_norm_features(rotated(keys, angle, 4), values, 4))
    assert features.shape == (5, 2 * (2 + 4 + 8 + 2))
    head1 = features[3, 16:]
    expected_pair0 = math.log(math.hypot(keys[1, 3, 0], keys[1, 3, 2]) + 1e-4)
    assert head1[0].item() == pytest.approx(expected_pair0, rel=1e-5)
    torch.testing.assert_close(head1[2:6], keys[1, 3, 4:])
    torch.testing.assert_close(head1[6:14], values[1, 3])
    assert head1[15].item() == pytest.approx(math.log(values[1, 3].norm().item() + 1e-4), rel=1e-5)


@pytest.mark.parametrize("features", sorted(FEATURE_SETS))
def test_input_dim_is_the_feature_width(features: str) -> None:
    spec = ScorerSpec("tiny", FINGERPRINT, 1, 2, 8, 4, "linear", features=features)
    assert FEATURE_SETS[features](torch.randn(2, 3, 8), torch.randn(2, 3, 8), 4).shape == (3, spec.input_dim)


def test_float16_files_round_the_weights_and_keep_the_standardisation(tmp_path: Path) -> None:
    spec = ScorerSpec("tiny", FINGERPRINT, 1, 2, 8, 8, "mlp", hidden_dim=3)
    g = torch.Generator().manual_seed(1)
    layer = {
        "mean": torch.randn(spec.input_dim, generator=g) * 1e-5,
        "scale": torch.rand(spec.input_dim, generator=g) * 1e-6 + 1e-7,
        "w1": torch.randn(spec.input_dim, 3, generator=g),
        "b1": torch.randn(3, generator=g),
        "w2": torch.randn(3, 2, generator=g),
        "b2": torch.randn(2, generator=g),
    }
    SurrogateScorer(spec, [layer]).save(tmp_path, dtype=torch.float16)
    loaded = SurrogateScorer.load(tmp_path).layers[0]
    assert torch.equal(loaded["scale"], layer["scale"]) and torch.equal(loaded["mean"], layer["mean"])
    for name in ("w1", "b1", "w2", "b2"):
        assert torch.equal(loaded[name], layer[name].half().float())
    stored = load_file(str(tmp_path / "weights.safetensors"))
    assert {name: t.dtype for name, t in stored.items() if name.endswith(("w1", "scale"))} == {
        "layers.0.w1": torch.float16,
        "layers.0.scale": torch.float32,
    }
