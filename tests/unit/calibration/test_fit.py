"""The per-layer fits: ridge recovers a planted linear target; the MLP learns what a linear fit cannot; a
per-head fit (the default) scores each head from its own features alone, a joint one reads every head; the
held-out metrics on known cases."""

from __future__ import annotations

import pytest
import torch

from vllm_kvevict.calibration.config import FitConfig
from vllm_kvevict.calibration.fit import fit_mlp, fit_ridge, predict
from vllm_kvevict.calibration.metrics import held_out_fit, r2_per_head, top_overlap
from vllm_kvevict.policies.surrogate_scorer import (
    ScorerSpec,
    SurrogateScorer,
    kv_pair_norm_features,
    scores_each_head_alone,
)


def planted(n: int = 4000, features: int = 12, heads: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g) * torch.linspace(0.1, 5.0, features) + 3.0
    weight = torch.randn(features, heads, generator=g)
    bias = torch.randn(heads, generator=g)
    return x, weight, bias, g


def test_ridge_recovers_a_planted_linear_target() -> None:
    x, weight, bias, g = planted()
    y = x @ weight + bias + 0.01 * torch.randn(x.shape[0], weight.shape[1], generator=g)
    fitted = fit_ridge(x, y, FitConfig(ridge=1e-6, heads="joint"))  # the planted weights mix features
    # back in the raw feature units: w1 / scale, and the intercept it implies
    raw = fitted["w1"] / fitted["scale"][:, None]
    torch.testing.assert_close(raw, weight, atol=2e-3, rtol=0)
    torch.testing.assert_close(fitted["b1"] - fitted["mean"] @ raw, bias, atol=2e-2, rtol=0)
    x_new = torch.randn(100, x.shape[1], generator=g)
    torch.testing.assert_close(predict(fitted, x_new), x_new @ weight + bias, atol=5e-2, rtol=0)


def test_a_strong_ridge_penalty_shrinks_towards_the_mean() -> None:
    x, weight, bias, _ = planted()
    fitted = fit_ridge(x, x @ weight + bias, FitConfig(ridge=1e6))
    assert float(fitted["w1"].abs().max()) < 1e-3


def test_the_mlp_fits_a_target_a_linear_fit_cannot() -> None:
    x, weight, _, g = planted(n=3000, features=4, heads=2)
    z = (x - x.mean(0)) / x.std(0)
    y = torch.stack([z[:, 0] ** 2, (z[:, 1] * z[:, 2]).abs()], dim=1)
    test_x = x[-500:]
    linear = fit_ridge(x[:-500], y[:-500], FitConfig(heads="joint"))  # y[:, 1] reads both halves
    mlp = fit_mlp(x[:-500], y[:-500], FitConfig(hidden_dim=32, epochs=40, seed=0, heads="joint"))
    linear_r2 = r2_per_head(predict(linear, test_x), y[-500:])
    mlp_r2 = r2_per_head(predict(mlp, test_x), y[-500:])
    assert bool((linear_r2 < 0.1).all()), linear_r2
    assert bool((mlp_r2 > 0.7).all()), mlp_r2


def test_top_overlap_and_r2_on_known_cases() -> None:
    target = torch.arange(8.0)[:, None].repeat(1, 2)  # [8 tokens, 2 heads]
    pred = torch.stack([torch.arange(8.0), -torch.arange(8.0)], dim=1)
    assert top_overlap(pred, target).tolist() == [1.0, 0.0]  # top 2 of 8: {6, 7} vs {6, 7} / {0, 1}
    torch.testing.assert_close(r2_per_head(target, target), torch.ones(2))
    fit = held_out_fit([pred], [target])
    assert fit["top25"] == 0.5


def per_head_layer(kind: str, heads: str, num_heads: int = 3, head_dim: int = 8, seed: int = 0):
    """A scorer of one layer fitted (``kind``, ``heads``) on kv-pair-norm features of random keys/values whose
    target mixes heads (head h's target reads head h and head h+1), and the features' per-head width."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (
        torch.randn(num_heads, 600, head_dim, generator=g),
        torch.randn(num_heads, 600, head_dim, generator=g),
    )
    x = kv_pair_norm_features(keys, values, head_dim)
    width = x.shape[1] // num_heads
    y = torch.stack([x[:, h * width] + x[:, ((h + 1) % num_heads) * width + 1] for h in range(num_heads)], 1)
    config = FitConfig(heads=heads, hidden_dim=32, epochs=2, seed=seed)
    fitted = {"linear": fit_ridge, "mlp": fit_mlp}[kind](x, y, config)
    spec = ScorerSpec(
        "test",
        {
            "architecture": "t",
            "num_hidden_layers": 1,
            "num_key_value_heads": num_heads,
            "head_dim": head_dim,
            "hidden_size": 0,
            "vocab_size": 0,
        },
        1,
        num_heads,
        head_dim,
        head_dim,
        kind,
        hidden_dim=32 if kind == "mlp" else None,
    )
    return SurrogateScorer(spec, [fitted]), width


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_per_head_fit_is_block_diagonal_and_a_head_scores_alone(kind: str) -> None:
    scorer, width = per_head_layer(kind, "separate")
    layer = scorer.layers[0]
    owner = torch.arange(layer["w1"].shape[0]) // width  # the head of each feature
    if kind == "linear":
        assert bool((layer["w1"][owner[:, None] != torch.arange(3)[None]] == 0).all())
    else:  # hidden unit m: reads features of one head only, feeds only that head's output
        for m in range(layer["w1"].shape[1]):
            read = owner[layer["w1"][:, m] != 0].unique().tolist()
            fed = (layer["w2"][m] != 0).nonzero()[:, 0].tolist()
            assert len(read) <= 1 and set(fed) <= set(read), (m, read, fed)
        assert (layer["w2"] != 0).any(dim=0).all()  # every head is fed
    assert scores_each_head_alone(scorer)
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(3, 20, 8, generator=g), torch.randn(3, 20, 8, generator=g)
    before = scorer.layer_scores(0, keys, values)
    for head in range(3):  # change every other head's rows: head h's scores stay
        others = torch.arange(3) != head
        changed_k, changed_v = keys.clone(), values.clone()
        changed_k[others] = torch.randn(2, 20, 8, generator=g) * 3
        changed_v[others] = torch.randn(2, 20, 8, generator=g) * 3
        after = scorer.layer_scores(0, changed_k, changed_v)
        torch.testing.assert_close(after[head], before[head], rtol=0, atol=0)
        assert not torch.equal(after[others], before[others])


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_joint_fit_reads_every_head(kind: str) -> None:
    scorer, _ = per_head_layer(kind, "joint")
    assert not scores_each_head_alone(scorer)


def test_an_unknown_head_mode_and_too_narrow_an_mlp_are_refused() -> None:
    x, weight, bias, _ = planted(n=100)
    with pytest.raises(ValueError, match="'both'.*separate, joint"):
        fit_ridge(x, x @ weight, FitConfig(heads="both"))
    with pytest.raises(ValueError, match="hidden_dim=2 must be at least the KV head count 3"):
        fit_mlp(x, x @ weight, FitConfig(hidden_dim=2, epochs=1))
