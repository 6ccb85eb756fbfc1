"""The plain reference model of the per-(request, KV head) sub-block tables that ``SubBlockStore`` keeps
(``vllm_kvevict/layout/subblock_store.py``), tested against it; not on the package path.

A layer cache ``[num_blocks, H, block_size, ...]`` is read as ``num_blocks * H`` sub-blocks of one head each
(sub-block id ``b * H + h``, see ``layout/kernels/views.py``). After eviction the heads of a layer keep
different numbers of tokens, so each head owns its own list of sub-blocks, taken from a free pool made of
*all* sub-blocks of the request's remaining blocks: any head may use any (block, head) region of them.

One ``SubBlockTable`` serves every layer whose heads kept the same counts: the assignment below is a pure
function of the counts and the block list, and every layer has its own cache tensor, so those layers can
share sub-block ids. ``RequestSubBlocks`` is the single owner of a request's tables on a worker.

The accounting rule (``layout/accounting.py``) guarantees the pool never runs dry: after t new tokens the
request holds ``ceil((B' + t)/bs) + 1`` blocks, i.e. ``H * (ceil((B' + t)/bs) + 1)`` sub-blocks, and a
layer needs ``Σ_h ceil((B_h + t)/bs) < H * ((B' + t)/bs + 1)`` of them when ``Σ_h B_h <= H * B'``.

``PooledRequestSubBlocks`` is the pooled mode (``docs/design_modes.md``, "Per-layer block budgets"): the
layers' caches form one array of sub-blocks with global ids, and one free list serves every layer, so the
same rule holds with B' the mean over all layers and heads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import torch

from vllm_kvevict.layout.subblock_ids import SubBlockPoolExhausted
from vllm_kvevict.layout.subblock_store import SubBlockStore


class SubBlockTable:
    """Sub-block lists and lengths of the H heads of one request, for the layers sharing these counts.

    subblocks[h]: sub-block ids of head h in token order; token j of head h lives at slot
    ``subblocks[h][j // block_size] * block_size + j % block_size`` of the one-head view.
    lengths[h]:   tokens head h holds (kept prompt tokens, then every token that came after).
    """

    def __init__(
        self, num_kv_heads: int, block_size: int, blocks: Iterable[int], free: deque[int] | None = None
    ) -> None:
        """free: the free pool to draw from, shared with other tables (pooled mode); a new one by default."""
        if num_kv_heads < 1 or block_size < 1:
            raise ValueError(f"num_kv_heads={num_kv_heads} and block_size={block_size} must be >= 1")
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.subblocks: list[list[int]] = [[] for _ in range(num_kv_heads)]
        self.lengths: list[int] = [0] * num_kv_heads
        self._free: deque[int] = deque() if free is None else free
        self.add_blocks(blocks)

    @classmethod
    def assign(
        cls, counts: Sequence[int], blocks: Sequence[int], num_kv_heads: int, block_size: int
    ) -> SubBlockTable:
        """A table whose head h holds ``counts[h]`` tokens, sub-blocks taken in order from ``blocks``.

        Deterministic: head 0 takes the first ceil(counts[0]/bs) free sub-blocks, then head 1, ...
        """
        if len(counts) != num_kv_heads:
            raise ValueError(f"counts has {len(counts)} entries, expected one per KV head ({num_kv_heads})")
        table = cls(num_kv_heads, block_size, blocks)
        for head, count in enumerate(counts):
            if count < 0:
                raise ValueError(f"counts[{head}]={count} must be >= 0")
            table._grow(head, int(count))
        return table

    def add_blocks(self, blocks: Iterable[int]) -> None:
        """Put every sub-block of newly granted ``blocks`` into the free pool (block order, then head)."""
        for block in blocks:
            if block < 0:
                raise ValueError(f"block id {block} must be >= 0")
            base = block * self.num_kv_heads
            self._free.extend(range(base, base + self.num_kv_heads))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def append(self, num_tokens: int) -> torch.Tensor:
        """Room for ``num_tokens`` new tokens on every head; [num_tokens, H] int64 slots they go to."""
        bs = self.block_size
        columns = []
        for head in range(self.num_kv_heads):
            start = self.lengths[head]
            self._grow(head, num_tokens)
            # Plain ints: this runs for every table and head of every decoding request at every step.
            table = self.subblocks[head]
            columns.append([table[j // bs] * bs + j % bs for j in range(start, start + num_tokens)])
        return torch.tensor(columns, dtype=torch.int64).T.reshape(num_tokens, self.num_kv_heads)

    def head_slots(self, head: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """[stop - start] int64 slots of tokens start..stop-1 of ``head`` (stop defaults to its length)."""
        stop = self.lengths[head] if stop is None else stop
        if not 0 <= start <= stop <= self.lengths[head]:
            raise ValueError(f"tokens [{start}, {stop}) outside head {head}'s {self.lengths[head]} tokens")
        tokens = torch.arange(start, stop, dtype=torch.int64)
        table = torch.tensor(self.subblocks[head], dtype=torch.int64)
        return table[tokens // self.block_size] * self.block_size + tokens % self.block_size

    def owned_subblocks(self) -> list[int]:
        """Every sub-block id this table holds, assigned or free (for leak checks)."""
        return [sb for head in self.subblocks for sb in head] + list(self._free)

    def _grow(self, head: int, num_tokens: int) -> None:
        needed = -(-(self.lengths[head] + num_tokens) // self.block_size) - len(self.subblocks[head])
        for _ in range(needed):
            if not self._free:
                raise SubBlockPoolExhausted(
                    f"head {head} needs a sub-block for token {self.lengths[head] + num_tokens - 1} but the "
                    f"request has none free (lengths {self.lengths}); the block accounting rule was broken"
                )
            self.subblocks[head].append(self._free.popleft())
        self.lengths[head] += num_tokens


class RequestSubBlocks:
    """All sub-block tables of one compacted request on one worker (one per distinct per-head counts).

    blocks: the request's block ids it keeps after eviction (block-table entries [first_block, ...)).
    layer_tables[l]: the table layer l reads and writes, set when layer l is compacted.
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, block_size: int, first_block: int, blocks: Sequence[int]
    ) -> None:
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.first_block = first_block
        self.blocks: list[int] = list(blocks)
        self.layer_tables: list[SubBlockTable | None] = [None] * num_layers
        self._by_counts: dict[tuple[int, ...], SubBlockTable] = {}

    @property
    def tables(self) -> list[SubBlockTable]:
        """The distinct tables, in creation order."""
        return list(self._by_counts.values())

    @property
    def fully_compacted(self) -> bool:
        return all(table is not None for table in self.layer_tables)

    def compact_layer(self, layer_idx: int, counts: Sequence[int], trailing_tokens: int = 0) -> SubBlockTable:
        """The table of ``layer_idx`` whose head h keeps ``counts[h]`` prompt tokens followed by
        ``trailing_tokens`` tokens computed in the same step after the prompt (a recomputed request).

        Layers with equal counts share one table; it is created (and grown) only once.
        """
        if self.layer_tables[layer_idx] is not None:
            raise RuntimeError(f"layer {layer_idx} is already compacted")
        key = tuple(int(c) for c in counts)
        table = self._by_counts.get(key)
        if table is None:
            table = SubBlockTable.assign(key, self.blocks, self.num_kv_heads, self.block_size)
            if trailing_tokens:
                table.append(trailing_tokens)
            self._by_counts[key] = table
        self.layer_tables[layer_idx] = table
        return table

    def sync_blocks(self, block_row: Sequence[int], num_blocks: int) -> None:
        """Take the blocks vLLM appended: ``block_row[first_block + len(blocks) : num_blocks]``."""
        start = self.first_block + len(self.blocks)
        new = [int(b) for b in block_row[start:num_blocks]]
        if not new:
            return
        self.blocks.extend(new)
        for table in self._by_counts.values():
            table.add_blocks(new)

    def append(self, num_tokens: int) -> dict[int, torch.Tensor]:
        """Grow every table by ``num_tokens``; {id(table): [num_tokens, H] int64 slots}."""
        return {id(table): table.append(num_tokens) for table in self._by_counts.values()}


class PooledRequestSubBlocks:
    """A compacted request's tables in the pooled mode: ONE free list of global sub-block ids shared by the
    ``SubBlockTable`` of each of its L layers.

    Head h of block b of layer l is global sub-block ``(l * NB + b) * H + h`` (NB = layer_blocks, the blocks
    of one layer's cache). Each kept block puts its L*H sub-blocks into the free list in layer, then head
    order (pool entry k: layer ``(k // H) % L``, block ``blocks[k // (L*H)]``, head slot ``k % H``). Layers
    are compacted in layer order, each taking its heads' sub-blocks in head order (then its trailing tokens',
    again in head order); every later token grows layer 0's heads, then layer 1's, ... So a layer may hold
    more sub-blocks than another: the request needs ``Σ_lh ceil((B_lh + t)/bs)`` of its ``L * H * N``.

    layer_tables[l]: layer l's table (global ids), set when layer l is compacted.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        block_size: int,
        layer_blocks: int,
        first_block: int,
        blocks: Sequence[int],
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.layer_blocks = layer_blocks
        self.first_block = first_block
        self.blocks: list[int] = []
        self.layer_tables: list[SubBlockTable | None] = [None] * num_layers
        self._free: deque[int] = deque()
        self._add_blocks(blocks)

    def subblock(self, layer: int, block: int, head: int) -> int:
        """Global id of head ``head`` of block ``block`` of layer ``layer``."""
        return (layer * self.layer_blocks + block) * self.num_kv_heads + head

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def tables(self) -> list[SubBlockTable]:
        """The compacted layers' tables, in layer order."""
        return [table for table in self.layer_tables if table is not None]

    def compact_layer(self, layer_idx: int, counts: Sequence[int], trailing_tokens: int = 0) -> SubBlockTable:
        """Layer ``layer_idx``'s table: head h keeps ``counts[h]`` prompt tokens then ``trailing_tokens``;
        the next layer in order (every earlier layer is compacted, no later one)."""
        if self.layer_tables[layer_idx] is not None or None in self.layer_tables[:layer_idx]:
            raise RuntimeError(f"layer {layer_idx} is compacted out of layer order")
        if len(counts) != self.num_kv_heads:
            raise ValueError(f"counts has {len(counts)} entries, expected {self.num_kv_heads}")
        table = SubBlockTable(self.num_kv_heads, self.block_size, [], free=self._free)
        for head, count in enumerate(counts):
            table._grow(head, int(count))
        if trailing_tokens:
            table.append(trailing_tokens)
        self.layer_tables[layer_idx] = table
        return table

    def sync_blocks(self, block_row: Sequence[int], num_blocks: int) -> None:
        """Take the blocks vLLM appended: ``block_row[first_block + len(blocks) : num_blocks]``."""
        self._add_blocks(block_row[self.first_block + len(self.blocks) : num_blocks])

    def append(self, num_tokens: int) -> list[torch.Tensor]:
        """Grow every layer (layer order, then head order) by ``num_tokens``; [num_tokens, H] slots each."""
        return [table.append(num_tokens) for table in self.tables]

    def owned_subblocks(self) -> list[int]:
        """Every global id this request holds, assigned or free (for leak checks)."""
        return [sb for table in self.tables for head in table.subblocks for sb in head] + list(self._free)

    def _add_blocks(self, blocks: Iterable[int]) -> None:
        for block_id in blocks:
            block = int(block_id)
            if not 0 <= block < self.layer_blocks:
                raise ValueError(f"block id {block} outside a layer's {self.layer_blocks} blocks")
            self.blocks.append(block)
            for layer in range(self.num_layers):
                self._free.extend(self.subblock(layer, block, h) for h in range(self.num_kv_heads))


def table_of(
    store: SubBlockStore, group: int, slot: int, num_kv_heads: int, block_size: int
) -> SubBlockTable:
    """The reference-model view of the table of batch ``slot`` for layer group ``group`` (inspection)."""
    lengths = store.lengths[group, slot].tolist()
    rows = store.tables[group, slot].tolist()
    table = SubBlockTable(num_kv_heads, block_size, [])
    table.lengths = lengths
    table.subblocks = [row[: -(-n // block_size)] for row, n in zip(rows, lengths, strict=True)]
    return table


def layer_table(worker, req_id: str, layer_idx: int) -> SubBlockTable:  # noqa: ANN001
    """A compacted request's table for ``layer_idx`` of an ``EvictionWorker`` as the reference model."""
    tables = worker.tables
    assert tables.store is not None
    slot = tables._slot_of[req_id]
    return table_of(tables.store, tables.group_of(layer_idx), slot, tables.num_kv_heads, tables.block_size)
