"""A ``SimulatedEngine`` whose tokens' keys depend on (position, head, layer) alone: the marks, then a fixed
random part scaled per layer; each value is minus its key. A token's row is the same wherever and whenever
it is written, so a test can score any held entry itself (``every_key``)."""

from __future__ import annotations

import torch
from simulated_engine import DIM, HEADS, LAYERS, SimulatedEngine

from vllm_kvevict.settings.config import EvictionConfig

MAX_POSITION = 600


class TokenKeyedEngine(SimulatedEngine):
    """``scales[l]``: the random part's scale in layer l (different scales give the layers different shares
    of a ranking across layers); ``seed``: the random part's."""

    def __init__(self, config: EvictionConfig, seed: int, scales: list[float]) -> None:
        super().__init__(config)
        g = torch.Generator().manual_seed(seed)
        self.random_part = [torch.randn(MAX_POSITION, HEADS, DIM, generator=g) * scale for scale in scales]

    def tokens(self, positions: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, _ = super().tokens(positions, layer)
        key[:, :, 3:] = self.random_part[layer][positions][:, :, 3:]
        return query, key, -key

    def every_key(self, layer: int) -> torch.Tensor:
        """[H, MAX_POSITION, D] the key each head of ``layer`` has at every position."""
        keys = self.random_part[layer].clone()
        keys[:, :, 0] = torch.arange(MAX_POSITION).float()[:, None]
        keys[:, :, 1] = torch.arange(HEADS).float()
        keys[:, :, 2] = layer
        return keys.transpose(0, 1)

    def held_now(self, req_id: str) -> list[list[list[int]]]:
        """Per layer and head, the positions ``req_id`` holds (``held``, each row checked to be its own)."""
        return [self.held(req_id, layer) for layer in range(LAYERS)]
