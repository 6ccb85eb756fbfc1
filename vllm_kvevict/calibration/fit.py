"""Fitting one layer's surrogate: closed-form ridge regression or a 2-layer GELU MLP (Adam), one output per KV
head, on standardised features. Weights come out in ``SurrogateScorer``'s layout (``mean``, ``scale``, ``w1``,
``b1`` and for an MLP ``w2``, ``b2``).

``FitConfig.heads`` says what each head's output reads. ``separate`` (the default): head h's output reads
only head h's block of features (features [N, F] are H blocks of F / H, head-major, as ``FEATURE_SETS``
lay them out), so ``w1`` (and an MLP's ``w2``) are block-diagonal and a head's score does not depend on what
the other heads hold in the same cache row: what per-chunk eviction needs, where after per-head eviction one
cache row holds different tokens in different heads (``policies.surrogate_scorer.scores_each_head_alone``).
``joint``: every output reads every head's features (right only where all heads hold the same tokens)."""

from __future__ import annotations

import torch

from vllm_kvevict.calibration.config import FitConfig

#: a feature whose spread is below this is constant on the corpus; it is divided by 1 instead
MIN_SCALE = 1e-6
#: what each head's output reads: its own head's features ("separate") or every head's ("joint")
HEAD_MODES = ("separate", "joint")


def standardisation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [F], scale [F]) of features x [N, F]."""
    scale = x.std(dim=0)
    return x.mean(dim=0), torch.where(scale > MIN_SCALE, scale, torch.ones_like(scale))


def check_heads(config: FitConfig) -> None:
    """ValueError naming ``config.heads`` unless it is one of ``HEAD_MODES``."""
    if config.heads not in HEAD_MODES:
        raise ValueError(f"heads={config.heads!r} is not valid; valid: {', '.join(HEAD_MODES)}")


def feature_heads(features: int, heads: int) -> torch.Tensor:
    """[features] the head whose block each feature is in (H head-major blocks of features / H)."""
    if features % heads:
        raise ValueError(f"{features} features do not split into {heads} equal head blocks")
    return torch.arange(features) // (features // heads)


def unit_heads(units: int, heads: int) -> torch.Tensor:
    """[units] the head each of an MLP's hidden units belongs to: ``heads`` contiguous blocks, as equal as
    the count allows (32 units of 3 heads: 11, 11, 10)."""
    if units < heads:
        raise ValueError(f"hidden_dim={units} must be at least the KV head count {heads} with heads=separate")
    return torch.arange(units) * heads // units


def same_head(rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """[len(rows), len(columns)] float mask: 1 where a row's head is a column's head."""
    return (rows[:, None] == columns[None]).float()


def fit_ridge(x: torch.Tensor, y: torch.Tensor, config: FitConfig) -> dict[str, torch.Tensor]:
    """Ridge weights for features x [N, F] and targets y [N, H]: minimises
    ``|z w + b - y|^2 / N + ridge * |w|^2`` on standardised z, solved in float64; with ``heads=separate``
    one ridge per head on that head's feature block, written into a block-diagonal ``w1`` [F, H]."""
    check_heads(config)
    mean, scale = standardisation(x)
    z = ((x - mean) / scale).double()
    y_mean = y.double().mean(dim=0)
    centred = y.double() - y_mean

    def ridge(columns: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        zc = z[:, columns]
        gram = zc.T @ zc / z.shape[0] + config.ridge * torch.eye(len(columns), dtype=torch.float64)
        return torch.linalg.solve(gram, zc.T @ targets / z.shape[0])

    if config.heads == "joint":
        w = ridge(torch.arange(z.shape[1]), centred)
    else:
        owner = feature_heads(z.shape[1], y.shape[1])
        w = torch.zeros(z.shape[1], y.shape[1], dtype=torch.float64)
        for h in range(y.shape[1]):
            columns = (owner == h).nonzero()[:, 0]
            w[columns, h] = ridge(columns, centred[:, h : h + 1])[:, 0]
    return {"mean": mean, "scale": scale, "w1": w.float(), "b1": y_mean.float()}


def fit_mlp(x: torch.Tensor, y: torch.Tensor, config: FitConfig) -> dict[str, torch.Tensor]:
    """MLP weights (F -> hidden_dim, GELU, -> H) for features x [N, F] and targets y [N, H]; trained on
    standardised targets with mean squared error, the target scale folded back into ``w2``/``b2``. With
    ``heads=separate`` the hidden units are split into H blocks (``unit_heads``), head h's units reading only
    head h's features and feeding only output h: H independent small MLPs, trained in one masked pass (a
    masked weight gets no gradient, so the blocks never exchange anything)."""
    check_heads(config)
    generator = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    mean, scale = standardisation(x)
    z = (x - mean) / scale
    y_mean, y_scale = standardisation(y)
    t = (y - y_mean) / y_scale
    heads = y.shape[1]
    first = torch.nn.Linear(z.shape[1], config.hidden_dim)
    second = torch.nn.Linear(config.hidden_dim, heads)
    reads = torch.ones_like(first.weight)  # [M, F] as first.weight
    feeds = torch.ones_like(second.weight)  # [H, M] as second.weight
    if config.heads == "separate":
        hidden = unit_heads(config.hidden_dim, heads)
        reads = same_head(hidden, feature_heads(z.shape[1], heads))
        feeds = same_head(torch.arange(heads), hidden)
        with torch.no_grad():  # a block's fan-in is 1/H of the layer's: nn.Linear's init scale for it
            first.weight.mul_(heads**0.5)
            second.weight.mul_(heads**0.5)
    optimiser = torch.optim.Adam([*first.parameters(), *second.parameters()], lr=config.lr)

    def forward(batch: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(torch.nn.functional.linear(batch, first.weight * reads, first.bias))
        return torch.nn.functional.linear(h, second.weight * feeds, second.bias)

    with torch.enable_grad():
        for _ in range(config.epochs):
            order = torch.randperm(z.shape[0], generator=generator)
            for batch in order.split(config.batch_size):
                loss = torch.nn.functional.mse_loss(forward(z[batch]), t[batch])
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
    with torch.no_grad():
        return {
            "mean": mean,
            "scale": scale,
            "w1": (first.weight * reads).T.contiguous(),
            "b1": first.bias.clone(),
            "w2": ((second.weight * feeds).T * y_scale).contiguous(),
            "b2": second.bias * y_scale + y_mean,
        }


FITTERS = {"linear": fit_ridge, "mlp": fit_mlp}


def predict(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """[N, H] outputs of a fitted layer (``SurrogateScorer``'s computation) for features x [N, F]."""
    y = ((x - weights["mean"]) / weights["scale"]) @ weights["w1"] + weights["b1"]
    if "w2" in weights:
        y = torch.nn.functional.gelu(y) @ weights["w2"] + weights["b2"]
    return y
