"""The question echo's forward pass (``question_echo.py`` finds the echo): each layer's echo attends to the
held entries of its request, read back from the cache without writing them, and to itself; then the layer
is compacted as the last chunk is (``ChunkEviction.choice``, ``work``), judged by the chunk's own last window
and the echo's queries."""

from __future__ import annotations

import numpy as np
import torch

from vllm_kvevict.datapath.chunk_eviction import ChunkEviction, HeldRows
from vllm_kvevict.datapath.executor import LayerCommit
from vllm_kvevict.datapath.moves import CacheRows, Moves
from vllm_kvevict.datapath.question_echo import EchoLayer, EchoRequest
from vllm_kvevict.datapath.shared_reads import HeldReads
from vllm_kvevict.datapath.step_timer import StepTimer
from vllm_kvevict.layout.batch_tables import host_to_device


class EchoPass:
    """The step's echo forward: which tokens run where, and each layer's attention and compaction."""

    def __init__(
        self,
        requests: list[EchoRequest],
        chunks: ChunkEviction,
        block_table: torch.Tensor,
        o_proj: dict[int, torch.Tensor],
        timer: StepTimer,
        commit: LayerCommit,
    ) -> None:
        row = 0
        for r in requests:
            r.row, row = row, row + r.width
        self.requests = requests
        self.num_tokens = row
        self._chunks = chunks
        self._block_table = block_table
        self._o_proj = o_proj
        self._timer = timer
        self._commit = commit
        self.kept: dict[str, list] = {}  # req -> per layer KeptTokens (records after the last layer)

    def input_ids(self, device: torch.device) -> torch.Tensor:
        """[N] int64 the echo tokens of every request, in order."""
        return host_to_device(np.array([t for r in self.requests for t in r.tokens]), device)

    def positions(self, device: torch.device) -> torch.Tensor:
        """[N] int64 positions: each request's echo right after its tokens computed so far (its prompt)."""
        spans = [np.arange(r.rescore.seq_len, r.rescore.seq_len + r.width) for r in self.requests]
        return host_to_device(np.concatenate(spans), device)

    def layer(self, layer_idx: int, tensors: EchoLayer, rows: CacheRows) -> Moves | None:
        """One layer of the echo forward: every request's echo attends to its held entries (read from the
        cache, nothing written) and to itself, into ``tensors.output``; then the layer is compacted, judged
        by the chunk's own last window and the echo's queries. Returns the layer's moves."""
        query, key, value = tensors.query, tensors.key, tensors.value
        moves = []
        reads = HeldReads(rows)
        for r in self.requests:
            rescore, rows_of = r.rescore, slice(r.row, r.row + r.width)
            block_row = self._block_table[rescore.slot]
            entries = self._chunks.held(layer_idx, rescore, block_row, self._commit.tables.check)
            held = self._chunks.read_held(entries, rescore, reads)
            assert held.values is not None  # read with values: the echo attends to them
            attended = echo_attention(
                query[rows_of],
                held.keys,
                held.values,
                key[rows_of],
                value[rows_of],
                tensors.scale,
                tensors.softcap,
            )
            tensors.output[rows_of] = attended.to(tensors.output.dtype)
            with self._timer.phase("total"):
                moves.append(self._compact(layer_idx, r, held, query[rows_of], block_row))
        return Moves.join(moves)

    def _compact(
        self, layer_idx: int, r: EchoRequest, held: HeldRows, echo_query: torch.Tensor, row: torch.Tensor
    ) -> Moves | None:
        """The deferred re-score of ``layer_idx`` over ``held`` (read once, for the echo's attention too),
        judged by ``r.policy`` (the method's copy that reads echo queries; between chunks the between-chunks
        rule around it) from the chunk's own last window and the echo's queries echo_query [W, Hq, D]. After
        the prompt's last chunk its queries are dropped after the last layer. ``row``: its block-table row."""
        chunks, rescore = self._chunks, r.rescore
        assert rescore.deferred and not self._commit.across_layers, "only a deferred re-score is echoed"
        echo = (r.policy, echo_query)
        choice = chunks.choice(layer_idx, rescore, held, echo_query, self._o_proj.get(layer_idx), echo)
        moves = self._commit.run(chunks.work(layer_idx, rescore, row, held.held, choice, rescore.trailing))
        self.kept.setdefault(rescore.req_id, []).append(chunks.evicted[rescore.req_id][layer_idx])
        if layer_idx == chunks.shape.num_layers - 1:
            chunks.evicted.pop(rescore.req_id)
            if rescore.final:
                chunks.queries.drop(rescore.req_id)
        return moves


def echo_attention(
    query: torch.Tensor,
    held_keys: torch.Tensor,
    held_values: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of an echo after its prompt, in float32: query [W, Hq, D] against the prompt's held entries
    held_keys/held_values [H, L, D] (all visible) and the echo's own key/value [W, H, D] (causal).
    Returns [W, Hq, D]."""
    width, q_heads, _ = query.shape
    heads = held_keys.shape[0]
    group = q_heads // heads
    keys = torch.cat([held_keys.float(), key.float().transpose(0, 1)], dim=1)  # [H, L + W, D]
    values = torch.cat([held_values.float(), value.float().transpose(0, 1)], dim=1)
    q = query.float().transpose(0, 1).reshape(heads, group * width, -1)  # [H, g*W, D], head-major groups
    scores = torch.einsum("hqd,hkd->hqk", q, keys) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    held = held_keys.shape[1]
    own = torch.arange(width, device=query.device)
    hidden = own[None, :] > own[:, None]  # [W, W] echo token i sees echo tokens j <= i
    mask = torch.zeros(width, held + width, dtype=torch.bool, device=query.device)
    mask[:, held:] = hidden
    scores = scores.view(heads, group, width, -1).masked_fill(mask, float("-inf"))
    out = torch.einsum("hgqk,hkd->hgqd", scores.softmax(dim=-1), values)  # [H, g, W, D]
    return out.reshape(q_heads, width, -1).transpose(0, 1)
