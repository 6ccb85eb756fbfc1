"""Held-out fit of a scorer: R^2 of the log-scores, overlap of the kept sets that eviction would pick."""

from __future__ import annotations

import torch

#: the kept share at which predicted and KVzip top sets are compared
TOP_FRACTION = 0.25


def r2_per_head(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[H] coefficient of determination of predictions pred [N, H] for targets [N, H]."""
    residual = ((target - pred) ** 2).sum(dim=0)
    spread = ((target - target.mean(dim=0)) ** 2).sum(dim=0).clamp_min(1e-12)
    return 1.0 - residual / spread


def top_overlap(pred: torch.Tensor, target: torch.Tensor, fraction: float = TOP_FRACTION) -> torch.Tensor:
    """[H] share of the target's top ``fraction`` tokens (per head, of one context: pred/target [c, H]) that
    the prediction's top ``fraction`` also holds."""
    k = max(1, round(pred.shape[0] * fraction))
    chosen = torch.zeros_like(pred, dtype=torch.bool).scatter_(0, pred.topk(k, dim=0).indices, True)
    wanted = torch.zeros_like(target, dtype=torch.bool).scatter_(0, target.topk(k, dim=0).indices, True)
    return (chosen & wanted).sum(dim=0).float() / k


def held_out_fit(preds: list[torch.Tensor], targets: list[torch.Tensor]) -> dict[str, float]:
    """{"r2", "top25"}: means over heads of R^2 (tokens of all contexts pooled) and over contexts and heads of
    ``top_overlap``, for one layer's predictions and targets, each a list over contexts of [c, H]."""
    r2 = r2_per_head(torch.cat(preds), torch.cat(targets)).mean()
    overlap = torch.stack([top_overlap(p, t) for p, t in zip(preds, targets, strict=True)]).mean()
    return {"r2": float(r2), "top25": float(overlap)}
