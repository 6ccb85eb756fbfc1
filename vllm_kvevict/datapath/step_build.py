"""Wiring one engine step (``step.EvictionStep``) from the planner's decisions (``step_plan.py``) once the
worker applied what they ask of its state: every per-step object is made here, none of the worker's state
changes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.datapath.attention_metadata import HeadBatchBuilder, StepSizes
from vllm_kvevict.datapath.cache_shape import CacheShape
from vllm_kvevict.datapath.chunk_eviction import ChunkEviction
from vllm_kvevict.datapath.decode_rescore import DecodeEviction
from vllm_kvevict.datapath.decode_schedule import CapStarts, Rescore
from vllm_kvevict.datapath.echo_pass import EchoPass
from vllm_kvevict.datapath.executor import layer_commit
from vllm_kvevict.datapath.layer_eviction import LayerTables
from vllm_kvevict.datapath.prompt_eviction import PromptEviction
from vllm_kvevict.datapath.query_ring import RingWrites
from vllm_kvevict.datapath.records import EvictionRecords
from vllm_kvevict.datapath.step import EvictionStep, StepTools, StepWork
from vllm_kvevict.datapath.step_plan import StepDecisions
from vllm_kvevict.datapath.step_timer import StepTimer
from vllm_kvevict.layout.batch_tables import BatchSubBlocks, StepLayout


@dataclass(frozen=True)
class WorkerParts:
    """The worker's collaborators a step works with: the worker owns them, the step's layers change them."""

    shape: CacheShape
    tables: BatchSubBlocks
    chunks: ChunkEviction
    decode: DecodeEviction | None
    records: EvictionRecords
    o_proj: dict[int, torch.Tensor]


def build_step(
    decided: StepDecisions,
    layout: StepLayout | None,
    decode_work: tuple[RingWrites | None, list[Rescore]],
    parts: WorkerParts,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> EvictionStep:
    """The step from the planner's decisions, once the worker prepared its state (caps admitted, tables
    split, rows grown into ``layout``, None: no request reads a compacted cache); wiring only.
    decode_work: the capped requests' ring writes and re-scores. block_table [R', W] / slot_mapping [T']:
    vLLM's tensors on the cache's device."""
    sizes = StepSizes(
        len(decided.q_lens),
        int(decided.q_lens.sum()),
        max_seq_len=int(decided.seq_lens.max(initial=0)),
        max_query_len=int(decided.q_lens.max(initial=0)),
        seq_lens=decided.seq_lens,
        prompt_lens=decided.prompt_lens,
        q_lens=decided.q_lens,
        compacted=decided.compacted if layout is not None else None,
    )
    timer = StepTimer()
    commit = layer_commit(LayerTables(parts.tables, block_table.device.type == "cpu"), parts.shape, timer)
    cap_starts = CapStarts(parts.decode.records if parts.decode is not None else {}, parts.shape.num_layers)
    prompts = PromptEviction(
        decided.compacting,
        parts.shape,
        parts.tables,
        (block_table, slot_mapping),
        parts.o_proj,
        parts.chunks.rope_inv_freq,
        parts.decode,
        parts.records,
        commit,
        cap_starts,
    )
    echo = None
    if decided.echo_requests:
        echo = EchoPass(decided.echo_requests, parts.chunks, block_table, parts.o_proj, timer, commit)
    ring_writes, rescores = decode_work
    work = StepWork(prompts, decided.chunks, rescores, ring_writes, echo)
    tools = StepTools(parts.chunks, parts.decode, parts.records, parts.o_proj, timer, commit, cap_starts)
    metadata = HeadBatchBuilder(sizes, parts.shape, parts.tables, layout, block_table)
    return EvictionStep(metadata, work, tools)
