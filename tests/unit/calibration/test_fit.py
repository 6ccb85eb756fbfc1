"""The per-layer fits: ridge recovers a planted linear target; the MLP learns what a linear fit cannot; the
held-out metrics on known cases."""

from __future__ import annotations

import torch

from vllm_kvevict.calibration.config import FitConfig
from vllm_kvevict.calibration.fit import fit_mlp, fit_ridge, predict
from vllm_kvevict.calibration.metrics import held_out_fit, r2_per_head, top_overlap


def planted(n: int = 4000, features: int = 12, heads: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g) * torch.linspace(0.1, 5.0, features) + 3.0
    weight = torch.randn(features, heads, generator=g)
    bias = torch.randn(heads, generator=g)
    return x, weight, bias, g


def test_ridge_recovers_a_planted_linear_target() -> None:
    x, weight, bias, g = planted()
    y = x @ weight + bias + 0.01 * torch.randn(x.shape[0], weight.shape[1], generator=g)
    fitted = fit_ridge(x, y, FitConfig(ridge=1e-6))
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
    linear = fit_ridge(x[:-500], y[:-500], FitConfig())
    mlp = fit_mlp(x[:-500], y[:-500], FitConfig(hidden_dim=32, epochs=40, seed=0))
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
