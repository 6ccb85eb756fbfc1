"""Per-chunk eviction on the worker: a prompt computed in several steps is evicted while it arrives.

With vLLM's chunked prefill (or a prompt whose first step does not start at token 0), the prompt's keys are
spread over several steps. After the step that brings a request from n0 to n1 computed tokens, each layer
re-scores what it holds — its entries kept so far plus the new chunk, read back from the cache — whenever the
accounting rule moves the offset (``RequestPlan.chunk_rescores``): between chunks every head keeps
``a(n1) = n1 - O(n1)`` entries (the same count in every head and layer, so the next chunk scores a dense
``[H, L]`` sequence), and once the prompt is complete the method's own selection keeps its layer budgets
(ragged across heads for Ada-KV). The observation window is the last ``window`` queries of the step's chunk:
the prompt's real last window (the question) at the final chunk. The scheduler frees the blocks the rule
frees; nothing crosses between the two sides.

Scores see the held entries in position order; pooling and span completion then treat two kept neighbours as
adjacent even where tokens between them were evicted, and the causal mask of the window takes the queries as
the newest held entries (docs/design.md). A chunk shorter than the window (a last chunk of 16 tokens) takes
the rest of its window from the previous chunks' queries, kept per request and layer (at most
``prompt_queries.MAX_SAVED_QUERIES``; methods that read more, such as H2O's every prompt query, see that
many).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.chunk_rescore import ChunkRescore
from vllm_kvevict.datapath.executor import LayerCommit, LayerWork
from vllm_kvevict.datapath.kept_selection import PrefillChoice
from vllm_kvevict.datapath.layer_eviction import HeldEntries, LayerTarget, held_in_store
from vllm_kvevict.datapath.moves import CacheRows, Moves
from vllm_kvevict.datapath.placement import Placement, standard_entries
from vllm_kvevict.datapath.pooled_eviction import pooled_plan
from vllm_kvevict.datapath.prompt_queries import PromptQueries
from vllm_kvevict.datapath.shared_reads import HeldReads
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.shared_prefix import first_kept_block
from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens, LayerKV, reads_values
from vllm_kvevict.policies.between_chunks import BetweenRule, between_chunks
from vllm_kvevict.policies.query_statistics import QueryStatistics


@dataclass(frozen=True)
class HeldRows:
    """What one head-major layer of a request holds (``held``) and, read from the cache, the keys/values
    [H, scored, D] of its prompt entries (scored = L minus the trailing tokens); values None when the policy
    judging them reads none (``reads_values``)."""

    held: HeldEntries
    keys: torch.Tensor
    values: torch.Tensor | None


class ChunkEviction:
    """Held positions of the requests evicted between chunks, and their per-layer re-score."""

    def __init__(self, shape: CacheShape, tables: BatchSubBlocks, between: BetweenRule | None = None) -> None:
        self.between = between or BetweenRule()  # how held entries are judged between chunks
        self.shape = shape
        self.tables = tables
        #: the model's RoPE inverse frequencies [r / 2] (set by the worker once the model is loaded)
        self.rope_inv_freq: torch.Tensor | None = None
        #: req -> per layer running statistics of every prompt query (Expected Attention only)
        self.statistics: dict[str, list[QueryStatistics]] = {}
        self.positions: dict[str, list[torch.Tensor | None]] = {}  # req -> per layer [H, a] held positions
        self.queries = PromptQueries(shape.num_layers)  # the newest prompt queries, per request and layer
        self.held_end: dict[str, int] = {}  # req -> tokens computed at its last eviction (later: all held)
        #: req -> what each layer holds after this step's re-score (taken by the step after the last layer)
        self.evicted: dict[str, list[KeptTokens | None]] = {}

    def drop(self, req_id: str) -> None:
        self.statistics.pop(req_id, None)
        self.evicted.pop(req_id, None)
        self.positions.pop(req_id, None)
        self.queries.drop(req_id)
        self.held_end.pop(req_id, None)

    @staticmethod
    def read_held(held: HeldEntries, r: ChunkRescore, reads: HeldReads, with_values: bool = True) -> HeldRows:
        """``held`` with its prompt entries' keys (and values, unless not ``with_values``), read from the
        cache through ``reads`` (a shared prefix once per layer and step)."""
        keys, values = reads.read(held.slots[:, : held.width - r.trailing], r.shared, with_values)
        return HeldRows(held, keys, values)

    def held(
        self, layer_idx: int, r: ChunkRescore, block_row: torch.Tensor, check: bool = True
    ) -> HeldEntries:
        """What each head of ``layer_idx`` holds after this step's chunk was written (every head holds the
        same count)."""
        if not r.compacted:
            return HeldEntries(
                *standard_entries(block_row, r.seq_len, self.shape.num_kv_heads, self.shape.block_size)
            )
        held = self.positions[r.req_id][layer_idx] if r.req_id in self.positions else None
        if self.tables.store is None or held is None:
            raise RuntimeError(
                f"request {r.req_id} layer {layer_idx}: compacted between chunks, no positions"
            )
        since = self.held_end[r.req_id]
        return held_in_store(self.tables, layer_idx, r.slot, held, since, r.seq_len, r.req_id, check)

    def rescore_layer(
        self,
        layer_idx: int,
        rescores: list[ChunkRescore],
        block_table: torch.Tensor,
        query: torch.Tensor,
        rows: CacheRows,
        o_proj: torch.Tensor | None,
        commit: LayerCommit,
    ) -> Moves | None:
        """Re-score ``layer_idx`` of every request in ``rescores`` that evicts in this forward and commit its
        new table (at the last layer of a table group; ranked across layers: at the last layer); query
        [T, Hq, D] holds the step's queries. Returns the moves to make in the layer's cache; what each
        layer holds now is in ``evicted`` (positions [H, M] -1 padded, counts [H])."""
        moves = []
        reads = HeldReads(rows)
        for r in rescores:
            self._update_statistics(layer_idx, r, query)
            if r.rescores_now:
                block_row = block_table[r.slot]
                held = commit.view(self.held(layer_idx, r, block_row, commit.tables.check), layer_idx)
                if commit.across_layers:
                    work = self._ranked_work(layer_idx, r, block_row, held, reads)
                else:
                    # the last chunk is judged by its method; between chunks by a rule that may read values
                    rows_read = self.read_held(held, r, reads, not r.final or reads_values(r.policy))
                    choice = self.choice(layer_idx, r, rows_read, query, o_proj)
                    work = self.work(layer_idx, r, block_row, held, choice, r.trailing)
                moved = commit.run(work)
                if moved is not None:
                    moves.append(moved)
            if not r.final or r.deferred:
                self.queries.save(layer_idx, r.req_id, query[r.q_start : r.q_start + r.q_len])
            elif layer_idx == self.shape.num_layers - 1:
                self.statistics.pop(r.req_id, None)  # the prompt is complete: no later chunk reads them
        return Moves.join(moves)

    def _ranked_work(
        self, layer_idx: int, r: ChunkRescore, block_row: torch.Tensor, held: HeldEntries, reads: HeldReads
    ) -> LayerWork:
        """``layer_idx`` of ``r`` ranked across layers: every held entry scored by its own cache row, what the
        method keeps by position forced kept (``forced_by_position``). Tokens after the prompt (a recomputed
        request, a kept context's creator) are the last columns while the request holds vLLM's layout and
        are kept whole; a compacted request's heads hold ragged counts: they are ranked, forced kept."""
        assert not r.deferred, "a pooled budget is judged without the question echo"
        trailing = 0 if r.compacted else r.trailing
        ranked = held.width - trailing
        positions = held.positions[:, r.shared : ranked]  # a shared prefix is neither read nor judged
        keys, values = reads.read(held.slots[:, r.shared : ranked].clamp(min=0), 0, True)  # padding: masked
        assert values is not None
        layer = LayerKV(
            keys=keys,
            values=values.to(keys.dtype),
            queries=keys[:, :0],
            layer_idx=layer_idx,
            num_layers=self.shape.num_layers,
        )
        window_end = r.prompt_len if r.final else r.seq_len
        forced = r.policy.forced_by_position(positions, window_end) & (positions >= 0)
        budget = r.budget(layer_idx) + r.trailing - trailing
        choice = PrefillChoice(r.policy, layer, budget, r.shared, own_rows=True, forced=forced)
        return self.work(layer_idx, r, block_row, held, choice, trailing)

    def work(
        self,
        layer_idx: int,
        r: ChunkRescore,
        block_row: torch.Tensor,
        held: HeldEntries,
        choice: PrefillChoice,
        trailing: int,
    ) -> LayerWork:
        """The layer's work: ``choice`` over ``held``, into the blocks the rule keeps after this chunk, the
        last ``trailing`` held entries of each head kept whole, a shared prefix kept where it is."""
        plan, heads = r.plan, self.shape.num_kv_heads
        adaptive = r.final and plan.adaptive  # the scores set the count, under the budget (accounting.py)

        def pooled_first(kept: list[KeptTokens]) -> int:
            return first_kept_block(pooled_plan(plan, kept, heads), r.shared, r.seq_len, r.spare)

        target = LayerTarget(
            r.slot,
            r.req_id,
            block_row,
            first_kept_block(plan, r.shared, r.seq_len, r.spare),
            cdiv(r.seq_len, self.shape.block_size) + r.spare,
            trailing,
            r.shared,
            adaptive_prompt=plan.prompt_len if adaptive else 0,
            pooled_first=pooled_first if adaptive else None,
        )

        def placed(_: KeptTokens, placement: Placement) -> None:
            self._commit(layer_idx, r, placement.held_positions(held.positions))

        return LayerWork(layer_idx, held, choice, target, placed)

    def reads_statistics(self, policy: EvictionPolicy, budget: int) -> bool:
        """True when a prompt is judged by Expected Attention, as its method or by the rule between chunks
        at ``budget``: its every prompt query is then folded into running statistics."""
        return (
            policy.reads_query_statistics
            or between_chunks(policy, self.between, budget).reads_query_statistics
        )

    def _update_statistics(self, layer_idx: int, r: ChunkRescore, query: torch.Tensor) -> None:
        """Fold this chunk's prompt queries into the request's running statistics, for a request judged by
        Expected Attention (its method, or the rule between chunks): every prompt query counts, not only
        the saved window."""
        if not r.reads_statistics or self.rope_inv_freq is None:  # None: no NeoX rotary embedding found
            return
        per_layer = self.statistics.get(r.req_id)
        if per_layer is None:
            inv_freq = self.rope_inv_freq.to(query.device)
            per_layer = [QueryStatistics(inv_freq) for _ in range(self.shape.num_layers)]
            self.statistics[r.req_id] = per_layer
        count = min(r.q_len, r.prompt_len - r.computed)
        if count > 0:
            positions = torch.arange(r.computed, r.computed + count, device=query.device)
            per_layer[layer_idx].update(query[r.q_start : r.q_start + count].transpose(0, 1), positions)

    def choice(
        self,
        layer_idx: int,
        r: ChunkRescore,
        held: HeldRows,
        query: torch.Tensor,
        o_proj: torch.Tensor | None,
        echo: tuple[EvictionPolicy, torch.Tensor] | None = None,
    ) -> PrefillChoice:
        """The choice over ``held``'s prompt entries: the method's after the last chunk, the between-chunks
        rule around it before; judged by the chunk's last window (from query [T, Hq, D]) or, with ``echo``
        (the method's echo-reading copy, the echo's queries [W, Hq, D]), by the chunk's own window and the
        echo's queries after it."""
        plan, keys, values = r.plan, held.keys, held.values
        scored = keys.shape[1]  # the prompt's entries; trailing tokens are kept after them
        budget = r.budget(layer_idx)
        tail = 0 if r.final else plan.trailing_held(r.seq_len - r.shared)[1]  # a trailing window, kept whole
        query_positions = None
        if echo is not None:  # the chunk's own last window, then the echo's queries after it
            echoing, echoed = echo
            policy = echoing if r.final else between_chunks(echoing, self.between, budget, tail)
            own = self.queries.window(layer_idx, r.req_id, r.policy.query_window(scored - r.shared))
            queries = torch.cat([own.to(echoed.dtype), echoed]).transpose(0, 1)
            first = scored - own.shape[0]
            query_positions = torch.arange(first, scored + echoed.shape[0], device=keys.device)
        else:
            prompt_end = r.q_start + (r.prompt_len - r.computed if r.final else r.q_len)
            policy = r.policy if r.final else between_chunks(r.policy, self.between, budget, tail)
            window = policy.query_window(scored - r.shared)
            queries = self.queries.observation(layer_idx, r.req_id, query[r.q_start : prompt_end], window)
        layer = LayerKV(
            keys=keys,
            values=None if values is None else values.to(keys.dtype),
            queries=queries.to(keys.dtype),
            query_positions=query_positions,
            layer_idx=layer_idx,
            num_layers=self.shape.num_layers,
            o_proj=o_proj,
            rope_inv_freq=self.rope_inv_freq,
            query_statistics=self.statistics[r.req_id][layer_idx] if r.req_id in self.statistics else None,
        )
        adaptive = r.final and r.plan.adaptive
        budget = min(budget, scored - r.shared)
        return PrefillChoice(policy, layer, budget, r.shared, uniform=not r.final, exact=not adaptive)

    def _commit(self, layer_idx: int, r: ChunkRescore, held: KeptTokens) -> None:
        """Record what the layer holds now: its positions (read by this layer's next re-score) and, for
        the step, its kept (``evicted``)."""
        per_layer = self.positions.setdefault(r.req_id, [None] * self.shape.num_layers)
        per_layer[layer_idx] = held.indices
        self.evicted.setdefault(r.req_id, [None] * self.shape.num_layers)[layer_idx] = held
        if layer_idx == self.shape.num_layers - 1:
            self.held_end[r.req_id] = r.seq_len
            self.tables.mark_compacted(r.slot, r.spare)
