"""SnapKV-style re-score while decoding: the held entries the last ``window`` queries attend to (Li et al.,
2024, applied at every re-score instead of once after prefill). https://arxiv.org/abs/2404.14469
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.policies.attention_scores import check_window_pooling, pool_scores
from vllm_kvevict.policies.decode.decode_policy import (
    DecodeEvictionPolicy,
    DecodeState,
    held_attention,
    recent_entries,
)
from vllm_kvevict.policies.decode.decode_states import WindowScores
from vllm_kvevict.policies.decode.held_layer import HeldLayer


@dataclass
class DecodeSnapKV(DecodeEvictionPolicy):
    """Score = mean attention of the last ``window`` queries per query head, pooled over neighbouring held
    entries (slot order, which is position order), then averaged over the GQA group, as the prefill
    ``SnapKV`` does; the newest ``window`` positions are always kept. Scores are replaced at each observe.

    It keeps state (``WindowScores``) where a wrapped prefill scorer would not, because it reads queries: the
    caller hands them to ``observe``, and ``select`` comes later, so the window's scores wait in between,
    slot-aligned with the held entries.
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_window_pooling(owner, self.window, self.kernel, self.pooling)

    @property
    def query_window(self) -> int:
        return self.window

    @property
    def min_cap(self) -> int:
        return self.window

    def init_state(self, num_kv_heads: int, device: torch.device | str) -> WindowScores:
        return WindowScores(num_kv_heads, device)

    def observe(
        self,
        state: DecodeState | None,
        held: HeldLayer,
        queries: torch.Tensor,
        query_positions: torch.Tensor,
    ) -> WindowScores:
        assert isinstance(state, WindowScores), "init_state gives SnapKV's state"
        keys, key_positions = held.key_rows(self._label()), held.positions
        state.fit(key_positions)
        query_positions = query_positions.to(device=keys.device, dtype=torch.int64)
        # The last `window` queries by position; absent ones (-1) sort first and drop out.
        last = query_positions.argsort()[-self.window :]
        probs, _ = held_attention(keys, key_positions, queries[:, last], query_positions[last])
        present = (query_positions[last] >= 0).sum().clamp(min=1)
        mean = probs.sum(dim=2) / present  # [kv_heads, g, L]
        state.values = group_mean_pooled(mean, key_positions, self.kernel, self.pooling)
        return state

    def scores(self, state: DecodeState | None, held: HeldLayer) -> torch.Tensor:
        assert isinstance(state, WindowScores), "init_state gives SnapKV's state"
        state.fit(held.positions)
        return state.values.masked_fill(recent_entries(held.positions, self.window), float("inf"))


def group_mean_pooled(
    mean: torch.Tensor, key_positions: torch.Tensor, kernel: int, pooling: str
) -> torch.Tensor:
    """Pool ``mean`` [kv_heads, g, L] over neighbouring held entries in position order, whatever the
    caller's slot layout (padding between entries is skipped), then average over the group: [kv_heads, L],
    -inf for padding."""
    valid = key_positions >= 0
    # Held entries first, by position; padding after them.
    order = torch.where(valid, key_positions, torch.iinfo(torch.int64).max).argsort(dim=1, stable=True)
    index = order[:, None, :].expand_as(mean)
    packed = mean.gather(2, index).masked_fill(~valid.gather(1, order)[:, None, :], 0.0)
    # Padding sits after every held entry: at a row's end, max pooling sees zeros where a sequence end
    # would give nothing, which a max of probabilities (>= 0) does not notice; avg pooling zero-pads anyway.
    pooled = pool_scores(packed, kernel, pooling).mean(dim=1)
    scores = torch.empty_like(pooled).scatter_(1, order, pooled)
    return scores.masked_fill(~valid, float("-inf"))
