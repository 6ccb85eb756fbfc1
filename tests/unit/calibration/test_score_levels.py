"""Per-layer levels of a scorer's predictions (``calibration/score_levels.py``): the mean and standard
deviation of every head's and token's score of a layer, pooled over contexts."""

from __future__ import annotations

import torch
from learned_scorers import random_scorer

from vllm_kvevict.calibration.score_levels import score_levels


def test_levels_are_the_pooled_mean_and_std_of_each_layers_scores() -> None:
    scorer = random_scorer(num_layers=2, kv_heads=3, head_dim=8, kind="mlp")
    g = torch.Generator().manual_seed(0)

    def rows(n: int) -> list[torch.Tensor]:
        return [torch.randn(3, n, 8, generator=g) for _ in range(2)]

    contexts = [(rows(n), rows(n)) for n in (5, 11)]
    levels = score_levels(scorer, contexts)
    assert levels["contexts"] == 2 and levels["tokens"] == 16
    for layer in range(2):
        pooled = torch.cat(
            [scorer.layer_scores(layer, keys[layer], values[layer]).flatten() for keys, values in contexts]
        ).double()
        assert abs(levels["mean"][layer] - float(pooled.mean())) < 1e-6
        assert abs(levels["std"][layer] - float(pooled.std(unbiased=False))) < 1e-6
