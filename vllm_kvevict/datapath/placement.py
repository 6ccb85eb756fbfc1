"""Where a layer's kept entries go, the same for the three eviction modes: the held entries of a head as
cache slots, the kept ones flattened head-major (trailing tokens after each head's kept ones), and the
moves from their slots to the sub-blocks the request keeps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.layout.subblock_ids import TableRows, head_token_index
from vllm_kvevict.policies.base import KeptTokens


def standard_entries(
    block_row: torch.Tensor, length: int, heads: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([H, L] int64 one-head-view slots, [H, L] int64 positions) of the first ``length`` tokens of a request
    still in vLLM's standard layout (block row [W]): head h of token j lies in sub-block ``block * H + h``."""
    j = torch.arange(length, device=block_row.device)
    head = torch.arange(heads, device=block_row.device)[:, None]
    block = block_row.to(torch.int64)[j // block_size][None, :]
    return (block * heads + head) * block_size + j % block_size, j.expand(heads, length).clone()


def subblock_slots(table: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """[H, width] int64 one-head-view slots of the first ``width`` entries of each head of a sub-block
    table [H, W] (entries past a head's table clamp to its last sub-block: callers mask them)."""
    j = torch.arange(width, device=table.device)
    rows = table.to(torch.int64)
    return rows[:, (j // block_size).clamp(max=rows.shape[1] - 1)] * block_size + j % block_size


@dataclass(frozen=True)
class Placement:
    """A layer's kept entries flattened head-major: entry k is held entry ``chosen[k]`` of head
    ``heads[k]`` and becomes token ``index[k]`` of that head's sub-blocks. per_head [H] = kept + trailing;
    ``kept`` [K] marks the entries the policy chose (the others are trailing tokens)."""

    per_head: torch.Tensor
    heads: torch.Tensor
    index: torch.Tensor
    chosen: torch.Tensor
    kept: torch.Tensor

    def held_positions(self, positions: torch.Tensor) -> KeptTokens:
        """Positions [H, M] (-1 padded) and counts [H] of what each head holds once placed, trailing entries
        included; ``positions`` [H, W]: the held entries' positions the placement chose from."""
        width = int(self.per_head.max()) if self.per_head.numel() else 0
        held = torch.full((positions.shape[0], width), -1, dtype=torch.int64, device=positions.device)
        held[self.heads, self.index] = positions[self.heads, self.chosen]
        return KeptTokens(held, self.per_head)

    def destinations(self, table: TableRows, block_size: int, after: int = 0) -> torch.Tensor:
        """[K] int64 one-head-view slots of each entry in ``table``, whose heads hold ``after`` entries of a
        shared prefix before them."""
        return table.token_slots(block_size, self.heads, self.index + after)


def place(kept: KeptTokens, trailing: int, trailing_from: int, total: int, device: torch.device) -> Placement:
    """Flatten ``kept`` (indices [H, M] -1 padded, counts [H]) then ``trailing`` tokens per head, held
    entries ``trailing_from`` onwards. ``total`` = sum of kept + trailing, known on the host (no sync)."""
    counts = kept.counts.to(device=device, dtype=torch.int64)
    per_head = counts + trailing
    heads, index = head_token_index(per_head, total)
    count_of = counts[heads]
    indices = kept.indices.to(device=device, dtype=torch.int64)
    kept_index = indices[heads, index.clamp(max=max(1, indices.shape[1]) - 1)] if indices.numel() else index
    is_kept = index < count_of
    chosen = torch.where(is_kept, kept_index, trailing_from + index - count_of)
    return Placement(per_head, heads, index, chosen, is_kept)
