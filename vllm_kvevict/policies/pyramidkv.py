"""PyramidKV: SnapKV scores with budgets shrinking linearly from the first layer to the last
(Cai et al., 2024). https://arxiv.org/abs/2406.02069
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict.policies.base import check_int
from vllm_kvevict.policies.snapkv import SnapKV


@dataclass
class PyramidKV(SnapKV):
    """SnapKV with per-layer budgets: a straight line from ``max_num`` (layer 0) to ``min_num`` (last
    layer) whose mean over layers is the uniform budget; ``beta`` sets the slope (min_num = budget / beta).

    The formula is kvpress's PyramidKVPress.get_layer_budget (after KVCache-Factory) with its kept count
    ``n * (1 - compression_ratio)`` replaced by our per-head ``budget``: when the line cannot fit between
    ``window`` and ``n - window`` the layer falls back to the uniform budget. Rounding half-to-even keeps
    the layer total equal to ``num_layers * budget`` (the line is symmetric around the budget). kvpress
    feeds the float ``n * (1 - ratio)`` into the formula: parity needs a ratio that makes it an integer.
    One difference: a single-layer model gets the uniform budget (kvpress gives it ``max_num``).
    """

    beta: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(type(self).__name__, "beta", self.beta, 1)

    def layer_budget(self, budget: int, num_tokens: int, layer_idx: int, num_layers: int) -> int:
        if budget >= num_tokens:
            return num_tokens
        min_num = budget / self.beta
        max_num = 2 * budget - min_num
        if max_num >= num_tokens - self.window:
            max_num = num_tokens - self.window
            min_num = 2 * budget - max_num
        if not num_tokens >= max_num >= min_num >= self.window:
            return max(1, budget)
        if num_layers == 1:
            # kvpress would return max_num here; a one-layer pyramid is just the uniform budget.
            return budget
        steps = (max_num - min_num) / (num_layers - 1)
        return min(num_tokens, round(max_num - layer_idx * steps))
