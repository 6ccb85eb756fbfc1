"""The learned scorer's file format, features and forward pass, against plain torch written out here."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_kvevict.policies.surrogate_scorer import (
    ScorerSpec,
    SurrogateScorer,
    kv_pair_norm_features,
    model_fingerprint,
)


def _rotate(keys: torch.Tensor, angle: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """keys [H, n, D] with each NeoX pair (i, i + r/2) rotated by angle[j, i] for token j."""
    half = rotary_dim // 2
    x, y = keys[..., :half], keys[..., half:rotary_dim]
    cos, sin = angle.cos(), angle.sin()
    return torch.cat([x * cos - y * sin, y * cos + x * sin, keys[..., rotary_dim:]], dim=-1)


_FINGERPRINT = {
    "architecture": "LlamaForCausalLM",
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_size": 32,
    "vocab_size": 100,
}


def _spec(kind: str, rotary_dim: int = 8) -> ScorerSpec:
    return ScorerSpec(
        model_name="tiny",
        fingerprint=_FINGERPRINT,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        rotary_dim=rotary_dim,
        kind=kind,
        hidden_dim=5 if kind == "mlp" else None,
    )


def _random_scorer(kind: str, rotary_dim: int = 8) -> SurrogateScorer:
    spec = _spec(kind, rotary_dim)
    g = torch.Generator().manual_seed(0)
    out = spec.hidden_dim if kind == "mlp" else spec.num_kv_heads
    layers = []
    for _ in range(spec.num_layers):
        layer = {
            "mean": torch.randn(spec.input_dim, generator=g),
            "scale": torch.rand(spec.input_dim, generator=g) + 0.5,
            "w1": torch.randn(spec.input_dim, out, generator=g),
            "b1": torch.randn(out, generator=g),
        }
        if kind == "mlp":
            layer["w2"] = torch.randn(out, spec.num_kv_heads, generator=g)
            layer["b2"] = torch.randn(spec.num_kv_heads, generator=g)
        layers.append(layer)
    return SurrogateScorer(spec, layers)


def test_features_do_not_change_when_rope_rotates_the_keys() -> None:
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, 7, 8, generator=g), torch.randn(2, 7, 8, generator=g)
    angle = torch.rand(7, 3, generator=g) * 2 * math.pi
    rotated = _rotate(keys, angle, rotary_dim=6)
    assert torch.allclose(
        kv_pair_norm_features(keys, values, 6), kv_pair_norm_features(rotated, values, 6), atol=1e-5
    )
    # but a rotation-variant coordinate (past rotary_dim) does change them
    moved = keys.clone()
    moved[..., 7] += 1.0
    assert not torch.allclose(kv_pair_norm_features(keys, values, 6), kv_pair_norm_features(moved, values, 6))


def test_features_layout_is_per_head_pair_norms_rest_values() -> None:
    keys = torch.tensor([[[3.0, 1.0, 4.0, 0.0, 2.0, 5.0]]])  # H=1, n=1, D=6, rotary 4: pairs (0,2), (1,3)
    values = torch.tensor([[[7.0, 8.0, 9.0, 1.0, 2.0, 3.0]]])
    got = kv_pair_norm_features(keys, values, 4)
    assert got.tolist() == [[5.0, 1.0, 2.0, 5.0, 7.0, 8.0, 9.0, 1.0, 2.0, 3.0]]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_scores_equal_the_written_out_model(kind: str) -> None:
    scorer = _random_scorer(kind)
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(2, 9, 8, generator=g), torch.randn(2, 9, 8, generator=g)
    w = scorer.layers[1]
    x = (kv_pair_norm_features(keys, values, 8) - w["mean"]) / w["scale"]
    y = x @ w["w1"] + w["b1"]
    if kind == "mlp":
        y = torch.nn.functional.gelu(y) @ w["w2"] + w["b2"]
    got = scorer.layer_scores(1, keys, values)
    assert got.shape == (2, 9)
    assert torch.allclose(got, y.T, atol=1e-5)


def test_a_token_scores_the_same_alone_and_among_others() -> None:
    scorer = _random_scorer("mlp")
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 12, 8, generator=g), torch.randn(2, 12, 8, generator=g)
    whole = scorer.layer_scores(0, keys, values)
    parts = torch.cat(
        [scorer.layer_scores(0, keys[:, i : i + 5], values[:, i : i + 5]) for i in (0, 5, 10)], 1
    )
    assert torch.allclose(whole, parts, atol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_save_and_load_round_trip(tmp_path, kind: str) -> None:
    scorer = _random_scorer(kind, rotary_dim=6)
    scorer.save(tmp_path / "s")
    loaded = SurrogateScorer.load(tmp_path / "s")
    assert loaded.spec == scorer.spec
    keys, values = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    assert torch.equal(loaded.layer_scores(0, keys, values), scorer.layer_scores(0, keys, values))


def test_load_names_the_directory_and_calibrate(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"not a scorer directory.*vllm-kvevict calibrate"):
        SurrogateScorer.load(tmp_path)


def test_mismatch_names_both_shapes() -> None:
    scorer = _random_scorer("linear")
    assert scorer.mismatch(dict(_FINGERPRINT)) is None
    other = _FINGERPRINT | {"vocab_size": 49152, "num_hidden_layers": 30}
    assert scorer.mismatch(other) == (
        "the scorer was fitted for tiny (num_hidden_layers=2, vocab_size=100); "
        "the served model has num_hidden_layers=30, vocab_size=49152"
    )


def test_fingerprint_reads_an_hf_config() -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        vocab_size=100,
    )
    assert model_fingerprint(config) == _FINGERPRINT


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kind": "tree"}, "kind 'tree' is not valid; valid: linear, mlp"),
        ({"kind": "mlp"}, "hidden_dim=None must be set exactly when kind is 'mlp'"),
        ({"rotary_dim": 7}, "rotary_dim=7 must be even"),
        ({"features": "hidden"}, "features 'hidden' are not known"),
    ],
)
def test_bad_specs_are_refused_naming_the_value(changes: dict, message: str) -> None:
    fields = {
        "fingerprint": _FINGERPRINT,
        "model_name": "m",
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 8,
        "rotary_dim": 8,
        "kind": "linear",
    }
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ScorerSpec(**(fields | changes))
