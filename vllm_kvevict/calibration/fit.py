"""Fitting one layer's surrogate: closed-form ridge regression or a 2-layer GELU MLP (Adam), one output per KV
head, on standardised features. Weights come out in ``SurrogateScorer``'s layout (``mean``, ``scale``, ``w1``,
``b1`` and for an MLP ``w2``, ``b2``)."""

from __future__ import annotations

import torch

from vllm_kvevict.calibration.config import FitConfig

#: a feature whose spread is below this is constant on the corpus; it is divided by 1 instead
MIN_SCALE = 1e-6


def standardisation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [F], scale [F]) of features x [N, F]."""
    scale = x.std(dim=0)
    return x.mean(dim=0), torch.where(scale > MIN_SCALE, scale, torch.ones_like(scale))


def fit_ridge(x: torch.Tensor, y: torch.Tensor, config: FitConfig) -> dict[str, torch.Tensor]:
    """Ridge weights for features x [N, F] and targets y [N, H]: minimises
    ``|z w + b - y|^2 / N + ridge * |w|^2`` on standardised z, solved in float64."""
    mean, scale = standardisation(x)
    z = ((x - mean) / scale).double()
    y_mean = y.double().mean(dim=0)
    gram = z.T @ z / z.shape[0] + config.ridge * torch.eye(z.shape[1], dtype=torch.float64)
    w = torch.linalg.solve(gram, z.T @ (y.double() - y_mean) / z.shape[0])
    return {"mean": mean, "scale": scale, "w1": w.float(), "b1": y_mean.float()}


def fit_mlp(x: torch.Tensor, y: torch.Tensor, config: FitConfig) -> dict[str, torch.Tensor]:
    """MLP weights (F -> hidden_dim, GELU, -> H) for features x [N, F] and targets y [N, H]; trained on
    standardised targets with mean squared error, the target scale folded back into ``w2``/``b2``."""
    generator = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    mean, scale = standardisation(x)
    z = (x - mean) / scale
    y_mean, y_scale = standardisation(y)
    t = (y - y_mean) / y_scale
    first = torch.nn.Linear(z.shape[1], config.hidden_dim)
    second = torch.nn.Linear(config.hidden_dim, y.shape[1])
    params = [*first.parameters(), *second.parameters()]
    optimiser = torch.optim.Adam(params, lr=config.lr)
    with torch.enable_grad():
        for _ in range(config.epochs):
            order = torch.randperm(z.shape[0], generator=generator)
            for batch in order.split(config.batch_size):
                loss = torch.nn.functional.mse_loss(
                    second(torch.nn.functional.gelu(first(z[batch]))), t[batch]
                )
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
    with torch.no_grad():
        return {
            "mean": mean,
            "scale": scale,
            "w1": first.weight.T.contiguous().clone(),
            "b1": first.bias.clone(),
            "w2": (second.weight.T * y_scale).contiguous(),
            "b2": second.bias * y_scale + y_mean,
        }


FITTERS = {"linear": fit_ridge, "mlp": fit_mlp}


def predict(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """[N, H] outputs of a fitted layer (``SurrogateScorer``'s computation) for features x [N, F]."""
    y = ((x - weights["mean"]) / weights["scale"]) @ weights["w1"] + weights["b1"]
    if "w2" in weights:
        y = torch.nn.functional.gelu(y) @ weights["w2"] + weights["b2"]
    return y
