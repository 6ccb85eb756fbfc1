"""Which batch slot holds which request, and the per-step update of the sub-block tensors. No vLLM import.

``BatchSubBlocks`` is the one owner of sub-block tables on a worker. Its ``SubBlockStore`` keeps rows per
batch slot in the order of vLLM's persistent input batch, so the kernels read views of it. Per step:

- ``begin``: when the batch's request ids differ from the last step's (requests arrived, left or were
  moved by vLLM's condensing), rows of compacted requests that left their slot are saved and put back where
  they arrive; requests starting from token 0 (new, or recomputed after preemption) start clean. A steady
  decode batch compares one list and does nothing else.
- ``layout``: when some request of the batch is compacted, every row grows by this step's tokens in one
  batched update and the step's head-as-sequence slot mapping, query offsets and row order are computed —
  from host arrays copied to the device once. Rows of standard-layout requests are kept only while such
  batches run; after other steps they are rebuilt from the block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_kvevict.layout.subblock_ids import TableRows
from vllm_kvevict.layout.subblock_store import SubBlockStore


def host_to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """[N] int64 host values on ``device`` without a host-device sync: on CUDA through pinned memory and a
    non-blocking copy (building the tensor on the device from pageable memory synchronises the step)."""
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True)
class StepLayout:
    """Head-as-sequence data of one step, shared by every group of layers.

    token_slots:     [G, T, H] int64 one-head-view slot of (token t, head h) for the layers of group g.
    query_start_loc: [H*R + 1] int32 query rows of sequence h*R + r (head-major, see ``block_tables``) in
                     the query regrouped [H*T, g, D]: head 0 of every token, then head 1, ...
    """

    token_slots: torch.Tensor
    query_start_loc: torch.Tensor


class BatchSubBlocks:
    """Sub-block tables of the requests in the batch, by batch slot (see the module docstring).

    shared: every layer uses one group of tables (policies whose heads keep equal counts in every layer);
    else one group per layer. ``split`` turns a shared store into per-layer groups (a request with a
    ragged-head policy arrived). layer_blocks: blocks per layer of a pooled store (``SubBlockStore``'s
    pooled mode: one group per layer, global sub-block ids), 0 for per-layer pools.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        block_size: int,
        shared: bool,
        capacity: int = 0,
        layer_blocks: int = 0,
    ) -> None:
        if layer_blocks and shared:
            raise ValueError("a pooled store (layer_blocks > 0) has one group per layer, never shared")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.shared = shared
        self.store: SubBlockStore | None = None
        self._initial_capacity = capacity
        self.layer_blocks = layer_blocks
        self._slot_ids: list[str | None] = []  # request id of each slot at the last step
        self._slot_of: dict[str, int] = {}
        self._compacted = np.zeros(0, dtype=bool)  # [S] the slot's request reads sub-block tables
        self._fresh = np.zeros(0, dtype=bool)  # [S] standard rows are up to date for the slot's request
        self._spare = np.zeros(0, dtype=np.int64)  # [S] spare blocks the slot's request holds (shared_prefix)
        self._saved: dict[str, dict[str, torch.Tensor]] = {}  # compacted requests out of the batch

    # ----- layer groups ---------------------------------------------------------------------------------
    def group_of(self, layer_idx: int) -> int:
        return 0 if self.shared else layer_idx

    def last_layer_of_group(self, layer_idx: int) -> bool:
        """True when no later layer reads the group of ``layer_idx`` (its tables may then change)."""
        return not self.shared or layer_idx == self.num_layers - 1

    def split(self) -> None:
        """One group per layer from now on (copies of the shared one)."""
        if self.shared:
            self.shared = False
            if self.store is not None:
                self.store.split_groups(self.num_layers)
            for saved in self._saved.values():  # rows of requests out of the batch get every group too
                for name in ("tables", "lengths", "cursor", "tail"):
                    value = saved[name]
                    saved[name] = value.expand(self.num_layers, *value.shape[1:]).clone()

    # ----- per step -------------------------------------------------------------------------------------
    def begin(self, req_ids: list[str], computed: np.ndarray, block_table: torch.Tensor) -> SubBlockStore:
        """Bring slots in line with this step's batch order; returns the store (created on first use)."""
        store = self._store_for(len(req_ids), block_table)
        if req_ids != self._slot_ids:
            self._move(req_ids, store)
        for slot in np.flatnonzero(computed == 0):  # only requests starting now: new or recomputed
            self._saved.pop(req_ids[slot], None)
            self._compacted[slot] = self._fresh[slot] = False
            self._spare[slot] = 0
        return store

    def compacted(self, num_reqs: int) -> np.ndarray:
        """[R] bool: the request in slot r reads sub-block tables (host mirror, no device read)."""
        return self._compacted[:num_reqs]

    def skip(self, num_reqs: int) -> None:
        """A step without head-as-sequence: standard rows are not kept up to date."""
        self._fresh[:num_reqs] = False

    def layout(
        self, computed: np.ndarray, q_lens: np.ndarray, block_table: torch.Tensor, check: bool
    ) -> StepLayout:
        """Grow every row by this step's tokens and build the step's head-as-sequence data.

        computed / q_lens: [R] host arrays (tokens cached before the step / computed in it);
        block_table: [R', Wb] vLLM's rows (R' >= R) on the cache's device."""
        store = self.store
        assert store is not None
        bs, heads = self.block_size, self.num_kv_heads
        num_reqs = len(q_lens)
        q_lens = q_lens.astype(np.int64)
        compacted = self._compacted[:num_reqs]
        # Standard rows not kept since the request's last step (or a long chunk) are rebuilt whole.
        rebuild = ~compacted & (~self._fresh[:num_reqs] | (q_lens > bs))
        growing = ~rebuild
        seq_lens = computed.astype(np.int64) + q_lens
        num_tokens = int(q_lens.sum())
        q_start = np.cumsum(q_lens) - q_lens
        req_of_token = np.repeat(np.arange(num_reqs), q_lens)
        token_offset = np.arange(num_tokens) - q_start[req_of_token]
        query_start_loc = np.zeros(num_reqs * heads + 1, dtype=np.int64)
        np.cumsum(np.tile(q_lens, heads), out=query_start_loc[1:])
        rebuilt = np.flatnonzero(rebuild)
        decode_only = bool((q_lens == 1).all())
        parts = [
            q_lens,
            -(-seq_lens // bs) + self._spare[:num_reqs],  # blocks of each row (spare blocks shift them)
            compacted,
            growing,
            req_of_token,
            token_offset,
            query_start_loc,
            rebuilt,
            seq_lens[rebuilt],
        ]
        # Everything the device needs from the host this step, in one copy.
        packed = host_to_device(np.concatenate([p.astype(np.int64) for p in parts]), store.device)
        q_dev, blocks_dev, compacted_dev, growing_dev, token_req, offsets, qsl, rebuilt_dev, rebuilt_lens = (
            packed.split([len(p) for p in parts])
        )
        if len(rebuilt):
            store.refresh_standard(rebuilt_dev, block_table[rebuilt_dev], rebuilt_lens)
        grown = q_lens[growing]
        max_new = -(-int(grown.max()) // bs) if len(grown) else 0
        store.grow(
            num_reqs,
            q_dev,
            growing_dev.bool(),
            compacted_dev.bool(),
            block_table[:num_reqs],
            blocks_dev,
            max_new,
            check,
            single_token=bool(len(grown)) and int(grown.max()) <= 1,
        )
        self._fresh[:num_reqs] = ~compacted
        req_of_token, token_offset = (None, None) if decode_only else (token_req, offsets)
        return StepLayout(store.token_slots(req_of_token, token_offset, q_dev, num_reqs), qsl.to(torch.int32))

    # ----- compaction -----------------------------------------------------------------------------------
    def commit(
        self,
        layer_idx: int,
        slot: int,
        table: TableRows,
        first_block: int,
        *,
        pool_cursor: int | torch.Tensor | None = None,
    ) -> None:
        """``table`` becomes the rows of ``slot`` for the group of ``layer_idx`` (pool_cursor: pooled mode,
        see ``SubBlockStore.commit``)."""
        assert self.store is not None
        self.store.commit(self.group_of(layer_idx), slot, table, first_block, pool_cursor=pool_cursor)

    def mark_compacted(self, slot: int, spare: int = 0) -> None:
        """Every layer of the request in ``slot`` is compacted: from the next step it reads its tables. spare:
        the spare blocks it was given (its row holds that many blocks more than its tokens need)."""
        self._compacted[slot] = True
        self._spare[slot] = spare

    def forget(self, req_id: str) -> None:
        """A finished, aborted or preempted request: its rows are not kept (its blocks go back to vLLM)."""
        self._saved.pop(req_id, None)
        slot = self._slot_of.get(req_id)
        if slot is not None:
            self._compacted[slot] = self._fresh[slot] = False
            self._spare[slot] = 0

    # ----- slots ----------------------------------------------------------------------------------------
    def _store_for(self, num_reqs: int, block_table: torch.Tensor) -> SubBlockStore:
        width = block_table.shape[1]
        if self.store is None:
            groups = 1 if self.shared else self.num_layers
            self.store = SubBlockStore(
                groups,
                self.num_kv_heads,
                self.block_size,
                width,
                max(num_reqs, self._initial_capacity),
                block_table.device,
                layer_blocks=self.layer_blocks,
            )
        self.store.ensure_capacity(num_reqs, width)
        if len(self._compacted) < self.store.capacity:
            grow = self.store.capacity - len(self._compacted)
            self._compacted = np.concatenate([self._compacted, np.zeros(grow, dtype=bool)])
            self._fresh = np.concatenate([self._fresh, np.zeros(grow, dtype=bool)])
            self._spare = np.concatenate([self._spare, np.zeros(grow, dtype=np.int64)])
        return self.store

    def _move(self, req_ids: list[str], store: SubBlockStore) -> None:
        """Requests left, arrived or moved: save the rows of compacted leavers, restore arrivals."""
        old = self._slot_ids
        both, span = sorted((len(old), len(req_ids)))  # slots held at the last step and now, either
        changed = [slot for slot in range(span) if slot >= both or old[slot] != req_ids[slot]]
        leaving = [slot for slot in changed if slot < len(old) and self._compacted[slot]]
        if leaving:
            saved = store.save(host_to_device(np.array(leaving), store.device))
            for i, slot in enumerate(leaving):
                self._saved[old[slot]] = {
                    name: value[:, i] if value.dim() > 1 else value[i] for name, value in saved.items()
                }
                self._saved[old[slot]]["spare"] = torch.tensor(int(self._spare[slot]))
        self._compacted[changed] = False
        self._fresh[changed] = False
        self._spare[changed] = 0
        arriving = [slot for slot in changed if slot < len(req_ids) and req_ids[slot] in self._saved]
        if arriving:
            rows = [self._saved.pop(req_ids[slot]) for slot in arriving]
            stacked = {
                name: torch.stack([r[name] for r in rows], dim=1 if rows[0][name].dim() > 0 else 0)
                for name in rows[0]
            }
            store.restore(host_to_device(np.array(arriving), store.device), stacked)
            self._compacted[arriving] = True
            self._spare[arriving] = stacked["spare"].numpy()
        self._slot_ids = list(req_ids)
        self._slot_of = {req_id: slot for slot, req_id in enumerate(req_ids)}

