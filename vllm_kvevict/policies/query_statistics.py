"""Running statistics of a layer's queries before RoPE, merged chunk by chunk (Chan's parallel update), and
the RoPE algebra they need: take RoPE out of post-RoPE queries at their positions, and the RoPE matrix
averaged over the positions still to come (Expected Attention's model of future queries)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE's partner of every coordinate: [..., r] -> [..., r], (x1, x2) -> (-x2, x1)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [t, 2 * len(inv_freq)] float32, of ``positions`` [t] (HF's LlamaRotaryEmbedding)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def unrotate(queries: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE queries from post-RoPE ``queries`` [h, t, d] at ``positions`` [t]: each rotated back by its
    own angle. The first ``2 * len(inv_freq)`` coordinates carry RoPE (partial rotary), the rest pass."""
    rotary = 2 * inv_freq.shape[0]
    cos, sin = rope_cos_sin(inv_freq.to(queries.device), positions.to(queries.device))
    head, tail = queries[..., :rotary], queries[..., rotary:]
    return torch.cat([head * cos - rotate_half(head) * sin, tail], dim=-1)


def average_rotation(inv_freq: torch.Tensor, start: int, count: int, dim: int) -> torch.Tensor:
    """[dim, dim] float32 mean RoPE matrix over positions ``start .. start + count - 1``: R x rotates x by
    a position's angles, ``R = cos * I + sin * P`` with ``P x = rotate_half(x)``."""
    rotary = 2 * inv_freq.shape[0]
    cos, sin = rope_cos_sin(inv_freq, torch.arange(start, start + count, device=inv_freq.device))
    mean_cos, mean_sin = cos.mean(dim=0), sin.mean(dim=0)  # [rotary]
    half = rotary // 2
    rotation = torch.eye(dim, device=inv_freq.device, dtype=torch.float32)
    rotation[:rotary, :rotary] = torch.diag(mean_cos)
    # rotate_half: out[:half] = -x[half:], out[half:] = x[:half]; entry (i, j) of P times sin_i.
    rows = torch.arange(half, device=inv_freq.device)
    rotation[rows, rows + half] = -mean_sin[:half]
    rotation[rows + half, rows] = mean_sin[half:]
    return rotation


@dataclass
class QueryStatistics:
    """Running mean and covariance of one layer's pre-RoPE queries, per query head, over every prompt
    position >= ``sinks`` seen so far; ``update`` once per chunk with its post-RoPE queries.

    count: queries merged; mean [q_heads, d] and scatter [q_heads, d, d] (sum of centred outer products)
    in float32; seen: one past the highest position fed (the first position still to come).
    """

    inv_freq: torch.Tensor
    sinks: int = 4
    count: int = 0
    mean: torch.Tensor | None = None
    scatter: torch.Tensor | None = None
    seen: int = 0

    def update(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Merge post-RoPE ``queries`` [q_heads, t, d] at ``positions`` [t] (positions < sinks ignored)."""
        positions = positions.to(device=queries.device, dtype=torch.int64)
        if positions.numel():
            self.seen = max(self.seen, int(positions.max()) + 1)
        take = positions >= self.sinks
        if not bool(take.any()):
            return
        pre = unrotate(queries[:, take].float(), positions[take], self.inv_freq)  # [h, t, d]
        t = pre.shape[1]
        chunk_mean = pre.mean(dim=1)
        centred = pre - chunk_mean[:, None]
        chunk_scatter = centred.transpose(1, 2) @ centred  # [h, d, d]
        if self.mean is None or self.scatter is None:
            self.count, self.mean, self.scatter = t, chunk_mean, chunk_scatter
            return
        total = self.count + t
        delta = chunk_mean - self.mean  # [h, d]
        self.scatter = (
            self.scatter + chunk_scatter + delta[:, :, None] * delta[:, None, :] * (self.count * t / total)
        )
        self.mean = self.mean + delta * (t / total)
        self.count = total

    @classmethod
    def of(
        cls, queries: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sinks: int
    ) -> QueryStatistics:
        """The statistics of ``queries`` [q_heads, t, d] at ``positions`` [t] in one update."""
        stats = cls(inv_freq=inv_freq, sinks=sinks)
        stats.update(queries, positions)
        return stats

    def future_moments(self, n_future_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean [q_heads, d], covariance [q_heads, d, d]) rotated by the average RoPE matrix of the next
        ``n_future_positions`` positions after ``seen``."""
        if self.mean is None or self.scatter is None:
            raise ValueError(f"no query at a position >= sinks={self.sinks} has been seen yet")
        rotation = average_rotation(
            self.inv_freq.to(self.mean.device), self.seen, n_future_positions, self.mean.shape[-1]
        )
        covariance = self.scatter / self.count
        return self.mean @ rotation.T, rotation @ covariance @ rotation.T
