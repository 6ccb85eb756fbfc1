"""Reference compaction plan for the layout tests (off the serving path): which kept (head, token) of
one layer goes to which sub-block slot of a ``SubBlockTable``, planned head by head.

The caller holds the layer's prompt keys/values in hand (the prompt was computed in this very step), so the
plan gathers from those tensors and scatters into the request's sub-blocks: no source is ever read from the
cache it overwrites, so there is no in-place move hazard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.unit.layout.subblock_reference import SubBlockTable


@dataclass(frozen=True)
class CompactionPlan:
    """Flat list of K token rows to write, in (head, kept order).

    src_tokens: [K] int64 token index inside the request's computed tokens (kept prompt tokens ascending,
                then the trailing tokens after the prompt).
    src_heads:  [K] int64 KV head of each row.
    dst_slots:  [K] int64 slot in the one-head view (``sub-block * block_size + offset``).
    """

    src_tokens: torch.Tensor
    src_heads: torch.Tensor
    dst_slots: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.src_tokens.numel())


def plan_compaction(
    kept_indices: torch.Tensor, kept_counts: torch.Tensor, table: SubBlockTable, prompt_len: int,
    trailing_tokens: int = 0,
) -> CompactionPlan:
    """Plan the writes of one layer of one request.

    kept_indices: [H, max_kept] sorted prompt-token indices per head, -1 padded (``KeptTokens.indices``).
    kept_counts:  [H] B_h (``KeptTokens.counts``); ``table`` must give head h exactly
                  B_h + trailing_tokens tokens.
    trailing_tokens: tokens computed after the prompt in the same step (positions prompt_len, ...); every
                  head keeps them after its kept prompt tokens.
    """
    num_heads = table.num_kv_heads
    if kept_indices.dim() != 2 or kept_indices.shape[0] != num_heads or kept_counts.shape != (num_heads,):
        raise ValueError(
            f"kept_indices {tuple(kept_indices.shape)} / kept_counts {tuple(kept_counts.shape)} do not match "
            f"the table's {num_heads} heads"
        )
    tokens, heads, slots = [], [], []
    for head in range(num_heads):
        count = int(kept_counts[head])
        if table.lengths[head] != count + trailing_tokens:
            raise ValueError(
                f"head {head}: table holds {table.lengths[head]} tokens, plan needs {count} kept + "
                f"{trailing_tokens} trailing"
            )
        kept = kept_indices[head, :count].to(device="cpu", dtype=torch.int64)
        if count and (int(kept.min()) < 0 or int(kept.max()) >= prompt_len):
            raise ValueError(f"head {head}: kept indices must lie in [0, {prompt_len}); got {kept.tolist()}")
        trailing = torch.arange(prompt_len, prompt_len + trailing_tokens, dtype=torch.int64)
        tokens.append(torch.cat([kept, trailing]))
        heads.append(torch.full((count + trailing_tokens,), head, dtype=torch.int64))
        slots.append(table.head_slots(head))
    return CompactionPlan(torch.cat(tokens), torch.cat(heads), torch.cat(slots))
