"""The scorers that ship for the bundled model score each KV head from its own head's features alone, so
per-chunk eviction is served with them (``scores_each_head_alone``), and their weights are float16."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from vllm_kvevict.policies.surrogate_scorer import (
    PACKAGED_SCORERS,
    WEIGHTS_FILE,
    SurrogateScorer,
    scores_each_head_alone,
)

SHIPPED = ("smollm2-135m-instruct-linear", "smollm2-135m-instruct-mlp")


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_scorer_scores_each_head_alone(name: str) -> None:
    scorer = SurrogateScorer.load(PACKAGED_SCORERS / name)
    assert scorer.spec.fit["heads"] == "separate"
    assert scores_each_head_alone(scorer)
    g = torch.Generator().manual_seed(0)
    shape = (scorer.spec.num_kv_heads, 16, scorer.spec.head_dim)
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    before = scorer.layer_scores(5, keys, values)
    keys[1:], values[1:] = keys[1:].flip(1), values[1:].roll(3, dims=1)  # other heads hold other tokens
    torch.testing.assert_close(scorer.layer_scores(5, keys, values)[0], before[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_scorer_stores_float16_weights(name: str) -> None:
    with safe_open(str(PACKAGED_SCORERS / name / WEIGHTS_FILE), "pt") as weights:
        assert weights.get_tensor("layers.0.w1").dtype == torch.float16
        assert weights.get_tensor("layers.0.mean").dtype == torch.float32
