"""Expected Attention: keep the keys that future queries are expected to attend to (Devoto et al., 2025).

https://arxiv.org/abs/2510.00636

The queries of the positions still to come are modelled per query head as a Gaussian: the mean and
covariance of the prompt's queries before RoPE (the first ``sinks`` positions left out), rotated by the RoPE
matrix averaged over the next ``n_future_positions`` positions. Under that model the expected attention
logit of key k is ``mu'.k / sqrt(d) + k^T Sigma' k / (2 d)``; its softmax over the keys, averaged over the
GQA group and weighted by ``||v||``, is the score (kvpress's ``ExpectedAttentionPress``).

Policies see post-RoPE queries (what vLLM's attention receives), so the statistics un-rotate each query by
its own position first, with the layer's RoPE frequencies (``LayerKV.rope_inv_freq``, NeoX rotate-half
layout, as Llama/Qwen/Mistral use in HF and in vLLM; without them, plain RoPE with base ``rope_theta``).
The statistics merge across chunks (Chan's parallel update), so a prompt evicted chunk by chunk is judged by
every query it has seen so far, not by the chunk's alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_kvevict.policies.attention_scores import extend_forward
from vllm_kvevict.policies.base import LayerKV, ScoredPolicy, check_fraction, check_int
from vllm_kvevict.policies.key_scored import sinks_and_recent
from vllm_kvevict.policies.query_statistics import QueryStatistics

#: kvpress's leaderboard entry (``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``); its press default is 0.
LEADERBOARD_EPSILON = 0.01


@dataclass
class ExpectedAttention(ScoredPolicy):
    """Score = ``(softmax over keys of the expected logit, GQA-group mean + epsilon) * ||v||`` (``use_vnorm``;
    without it the softmax alone); the first ``sinks`` tokens are always kept and take no part in the
    statistics or the softmax. ``use_covariance=False`` drops the ``k^T Sigma' k`` term.

    Ours on top (0 / 0 is kvpress's press): the last ``window`` tokens always kept, and ``span_after`` as in
    SnapKV. Defaults 32 / 8, the product's: kvpress compresses the context before the question is appended,
    so its press never judges the prompt's last tokens; here the whole prompt is compressed, and without
    a window the chat template's tail (the assistant header) is evicted and generation degenerates
    (docs/question_first.md). The queries come from ``LayerKV.query_statistics`` when the caller carries
    them across chunks, else from ``LayerKV.queries`` (all prompt queries: ``query_window(n) == n``) at
    ``LayerKV.positions()``. ``epsilon`` defaults to kvpress's leaderboard value (its press default is 0).
    """

    n_future_positions: int = 512
    sinks: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = LEADERBOARD_EPSILON
    window: int = 32
    span_after: int = 8
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_int(owner, "n_future_positions", self.n_future_positions, 1)
        check_int(owner, "sinks", self.sinks, 0)
        check_int(owner, "window", self.window, 0)
        check_int(owner, "span_after", self.span_after, 0)
        check_fraction(owner, "epsilon", self.epsilon, 0.0, 1.0)
        if (
            isinstance(self.rope_theta, bool)
            or not isinstance(self.rope_theta, int | float)
            or self.rope_theta <= 1
        ):
            raise ValueError(f"{owner}: rope_theta={self.rope_theta!r} is not valid; it must be a number > 1")
        for flag in ("use_covariance", "use_vnorm"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(
                    f"{owner}: {flag}={getattr(self, flag)!r} is not valid; it must be true or false"
                )

    @property
    def min_budget(self) -> int:
        return self.sinks + self.window

    @property
    def reads_query_statistics(self) -> bool:
        return True

    def query_window(self, num_tokens: int) -> int:
        return num_tokens

    def always_kept(self, num_tokens: int, budget: int) -> torch.Tensor:
        return sinks_and_recent(num_tokens, self.sinks, self.window)

    def inv_freq(self, layer: LayerKV) -> torch.Tensor:
        """[d / 2] the layer's RoPE inverse frequencies, or plain RoPE's with base ``rope_theta`` over the
        whole head when the caller does not give them."""
        if layer.rope_inv_freq is not None:
            return layer.rope_inv_freq.float()
        d = layer.keys.shape[2]
        exponents = torch.arange(0, d, 2, dtype=torch.float32, device=layer.keys.device) / d
        return 1.0 / (float(self.rope_theta) ** exponents)

    def statistics(self, layer: LayerKV) -> QueryStatistics:
        """The layer's carried statistics, or those of its queries."""
        if layer.query_statistics is not None:
            return layer.query_statistics
        return QueryStatistics.of(layer.queries, layer.positions(), self.inv_freq(layer), self.sinks)

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        n, sinks = layer.num_tokens, min(self.sinks, layer.num_tokens)
        keys = layer.keys[:, sinks:].float()  # [H, m, d]
        heads, m, d = keys.shape
        group = layer.group_size
        mean, covariance = self.statistics(layer).future_moments(self.n_future_positions)
        grouped = keys.repeat_interleave(group, dim=0)  # [Hq, m, d]
        logits = (grouped @ mean[:, :, None]).squeeze(-1) / math.sqrt(d)  # [Hq, m]
        if self.use_covariance:
            logits = logits + ((grouped @ covariance) * grouped).sum(dim=-1) / d / 2
        probabilities = torch.softmax(logits, dim=-1).reshape(heads, group, m).mean(dim=1)  # [H, m]
        if self.use_vnorm:
            norms = layer.value_rows(self._label())[:, sinks:].float().norm(dim=-1)
            probabilities = (probabilities + self.epsilon) * norms
        scores = torch.full((heads, n), float("inf"), device=keys.device)
        scores[:, sinks:] = extend_forward(probabilities, self.span_after)
        recent = self.always_kept(n, budget).to(scores.device)
        scores[:, recent] = float("inf")
        return scores

