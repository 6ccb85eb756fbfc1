"""NaCl: proxy-token attention plus head-wise random sampling, one eviction at encoding time
(Chen et al., ACL 2024). https://arxiv.org/abs/2408.03675
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kvevict.policies.attention_scores import group_mean, window_attention
from vllm_kvevict.policies.base import KeptTokens, LayerKV, check_fraction, check_int
from vllm_kvevict.policies.kept_masks import sample_per_head, top_k_mask
from vllm_kvevict.policies.snapkv import ObservationWindowPolicy, window_queries


@dataclass
class NaCl(ObservationWindowPolicy):
    """Proxy-tokens eviction + random eviction, as we read the paper.

    The proxy tokens are the last ``window`` prompt tokens (where the question of a prompt sits); they are
    kept. Each other token's score is the attention the proxy queries give it (mean over them and over
    the GQA group). Of the per-head budget left after the proxies, ``1 - random_ratio`` goes to the top
    scores, and ``random_ratio`` is drawn at random without replacement from the rest, with probability
    proportional to the score, independently per head and layer (``torch.Generator`` seeded from
    ``(seed, layer_idx, head)``) - the paper's remedy for attention bias.
    """

    reads_own_values: ClassVar[bool] = False

    window: int = 32
    random_ratio: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_int(owner, "window", self.window, 1)
        check_fraction(owner, "random_ratio", self.random_ratio, 0.0, 1.0)
        check_int(owner, "seed", self.seed, 0)

    def select(self, layer: LayerKV, budget: int) -> KeptTokens:
        n, kv_heads = layer.num_tokens, layer.num_kv_heads
        if (everything := self.keep_all_or_check(layer, budget)) is not None:
            return everything
        window = min(self.window, n)
        queries, positions = window_queries(layer, window + self.echo_queries, type(self).__name__)
        scores = group_mean(window_attention(queries, layer.keys, positions), kv_heads)
        candidates = torch.zeros(kv_heads, n, dtype=torch.bool, device=scores.device)
        candidates[:, : n - window] = True
        free = budget - window
        sampled_count = round(free * self.random_ratio)
        by_score = top_k_mask(scores, free - sampled_count, eligible=candidates)
        sampled = sample_per_head(scores, sampled_count, candidates & ~by_score, self.seed, layer.layer_idx)
        return KeptTokens.from_mask(by_score | sampled | ~candidates)
