"""Worker side of a kept context (``layout/context_reuse.py``): a creator compacts the block-aligned part of
its prompt into whole blocks that nothing writes again, and a reader that starts from those blocks reads
exactly the creator's kept entries, then its own tokens, from fresh blocks. ``SimulatedEngine`` drives the
worker as the CPU backend does; every cached row says which (position, head, layer) it is."""

from __future__ import annotations

import pytest
import torch
from simulated_engine import BS, HEADS, LAYERS, NUM_BLOCKS, SimulatedEngine

from vllm_kvevict.layout.context_reuse import EntryCounts, context_len, entry_blocks, keeps_entry
from vllm_kvevict.settings.config import EvictionConfig

PROMPT = 410  # not block-aligned: the context is its first 400 tokens
QUESTION = 30
KEEP = {"kv_context": "keep"}


POOLED = "kvzap-across-layers"  # kvzap with budget_scope "model": blocks pooled across layers


def server(method: str) -> EvictionConfig:
    params = {"budget_scope": "model"} if method == POOLED else {}
    return EvictionConfig.from_dict(
        {
            "method": "kvzap" if method == POOLED else method,
            "budget": 0.25,
            "params": params,
            "prefill": "whole",
            "decode": {"method": "none"},
        }
    )


def create(engine: SimulatedEngine, chunks: list[int], args: dict) -> None:
    done = 0
    for end in chunks:
        engine.step([("creator", PROMPT, done, end - done, args)])
        done = end


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("snapkv", KEEP),
        ("knorm", KEEP),
        ("keydiff", KEEP),
        ("expected-attention", KEEP),
        ("streamingllm", KEEP),
        ("ada-snapkv", {**KEEP, "kv_eviction": "snapkv"}),  # per-layer tables on the server
        ("ada-snapkv", KEEP),  # Ada-KV: head counts in whole blocks, per layer
        ("ada-expected-attention", KEEP),
        ("snapkv", {**KEEP, "kv_eviction": "ada-snapkv"}),  # one table group until the creator splits it
        (POOLED, KEEP),  # ranked across layers: counts per (layer, head) in whole blocks, one pool
    ],
)
@pytest.mark.parametrize(
    "chunks", [[PROMPT], [256, PROMPT], [405, PROMPT]], ids=["whole", "2-chunks", "tail"]
)
def test_a_reader_reads_the_creators_kept_context_and_nothing_writes_it(method, args, chunks):
    engine = SimulatedEngine(server(method))
    worker = engine.worker
    create(engine, chunks, args)
    setting = worker.settings.resolve(args)
    context = setting.plan_for(context_len(PROMPT, BS))
    assert keeps_entry(context) and context.prompt_len == 400
    entry = entry_blocks(context)
    kept = context.kept_bound
    creator = [engine.held("creator", layer) for layer in range(LAYERS)]
    counts = [[len(head) - (PROMPT - 400) for head in heads] for heads in creator]
    pooled = method == POOLED
    assert sum(map(sum, counts)) == LAYERS * HEADS * kept
    for layer in range(LAYERS):
        # H·B' per layer (all layers' together when pooled), split in whole blocks
        assert pooled or sum(counts[layer]) == len(counts[layer]) * kept
        for head, count in zip(creator[layer], counts[layer], strict=True):
            assert count % BS == 0 and (count == kept or setting.method.startswith("ada-") or pooled)
            assert all(p < 400 for p in head[:count]) and head[:count] == sorted(set(head[:count]))
            assert head[count:] == list(range(400, PROMPT))  # the prompt's tail is kept after the context
    entry_rows = engine.rows["creator"][entry.first : entry.first + entry.count]
    snapshot = [cache[entry_rows].clone() for cache in engine.caches]

    engine.read_context("reader", "creator", entry.first, entry.count, entry.reader_first)
    reader_prompt = 400 + QUESTION
    engine.step([("creator", PROMPT, PROMPT, 1, args), ("reader", reader_prompt, 400, QUESTION, args)])
    for t in range(BS + 2):  # both decode; the reader crosses into a second block of its own
        engine.step(
            [
                ("creator", PROMPT, PROMPT + 1 + t, 1, args),
                ("reader", reader_prompt, reader_prompt + t, 1, args),
            ]
        )
    own = set(engine.rows["reader"][400 // BS :])
    for layer in range(LAYERS):
        assert torch.equal(engine.caches[layer][entry_rows], snapshot[layer]), "an entry block was written"
        reader = engine.held("reader", layer)
        for head, context_entries, count in zip(reader, creator[layer], counts[layer], strict=True):
            assert head[:count] == context_entries[:count]
            assert head[count:] == list(range(400, reader_prompt + BS + 2))
        read = {block % NUM_BLOCKS for block in engine.blocks_read("reader", layer)}
        assert 0 not in read  # never a null block
        assert read <= set(entry_rows) | own if pooled else read == set(entry_rows) | own
    assert "reader" not in worker.context_readers  # set up once, then an ordinary compacted request


def test_ada_kv_heads_differ_in_a_kept_context():
    """The Ada-KV entry is not a uniform one in disguise: some layer's heads keep different counts."""
    engine = SimulatedEngine(server("ada-snapkv"))
    create(engine, [PROMPT], KEEP)
    held = [[len(head) for head in engine.held("creator", layer)] for layer in range(LAYERS)]
    assert any(len(set(layer)) > 1 for layer in held)
    first_block = engine.rows["creator"][entry_blocks(engine.worker.plan_for(400)).first]
    assert engine.worker.entry_counts.counts_of(first_block) == [
        [count - (PROMPT - 400) for count in layer] for layer in held
    ]


def test_a_context_ranked_across_layers_keeps_different_counts_by_layer():
    """The pooled entry is not a per-layer one in disguise: the layers' shares differ, and its counts are
    recorded for the readers."""
    engine = SimulatedEngine(server(POOLED))
    create(engine, [PROMPT], KEEP)
    held = [[len(head) - (PROMPT - 400) for head in engine.held("creator", layer)] for layer in range(LAYERS)]
    assert len({sum(layer) for layer in held}) > 1
    first_block = engine.rows["creator"][entry_blocks(engine.worker.plan_for(400)).first]
    assert engine.worker.entry_counts.counts_of(first_block) == held


def test_a_creator_whose_method_keeps_no_context_keeps_its_prompt_as_usual():
    """PyramidKV's layers keep different budgets: the request is refused its context (the API's 400) and
    falls back to the server's setting, planned like any other."""
    engine = SimulatedEngine(server("pyramidkv"))
    create(engine, [PROMPT], KEEP)
    assert "creator" not in engine.worker.context_lens
    assert engine.worker.requests["creator"] == engine.worker.plan_for(PROMPT)


def test_dropping_requests_leaves_no_context_state():
    engine = SimulatedEngine(server("snapkv"))
    create(engine, [PROMPT], KEEP)
    entry = entry_blocks(engine.worker.plan_for(400))
    engine.read_context("reader", "creator", entry.first, entry.count, entry.reader_first)
    engine.step([("reader", 400 + QUESTION, 400, QUESTION, KEEP)])
    assert engine.worker.context_lens == {"creator": 400}
    engine.worker.drop(["creator", "reader"])
    assert not engine.worker.context_lens and not engine.worker.context_readers
    assert not engine.worker.shared_tokens and not engine.worker.requests


def test_a_reader_of_ragged_counts_the_worker_never_recorded_stops_loudly():
    """Every Ada-KV entry's counts are recorded by the worker that compacted its creator; a reader whose
    first entry block has none would read the wrong entries, so it raises instead."""
    counts = EntryCounts()
    counts.record(7, [[32, 64], [64, 32]])
    assert counts.counts_of(7) == [[32, 64], [64, 32]]
    counts.record(7, [[48, 48], [48, 48]])  # the block went to a later creator
    assert counts.counts_of(7) == [[48, 48], [48, 48]]
    with pytest.raises(RuntimeError, match="no kept context with ragged counts starts at block 8"):
        counts.counts_of(8)
