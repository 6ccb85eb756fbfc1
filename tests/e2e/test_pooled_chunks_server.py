"""A budget pooled across layers, evicted chunk by chunk and kept as a context through a real server:
``vllm serve --kv-eviction kvzap --kv-budget 0.25 --kv-eviction-config '{"budget_scope": "model", "prefill":
"chunked"}'`` with vLLM's chunked prefill at 256 tokens per step and prefix caching on
(``docs/design_modes.md``, "Per-layer block budgets").

An 1100-token prompt arrives in five chunks and is evicted after three of them (each a ranking of every
layer's held entries, read back from sub-blocks in any layer's region) and after its last one, while a short
uncompacted request and another chunked one share its steps. The worker's debug dump records what every
(layer, KV head) held after each evicting chunk; HF transformers (float32, ``hf_reference.chunked``) prefills
the same prompt segment by segment with exactly those entries hidden, then teacher-forces vLLM's tokens with
the final kept sets. A full-cache HF run is the control: where the two differ, vLLM must side with the
chunk-wise masked run.

Then a document kept as a context (``kv_context: "keep"``, ``kv_prefill: "whole"``, 10 %): its creator is
computed in chunks and ranked across layers once, every (layer, head) count in whole blocks; a reader
starts from the entry (vLLM's prefix-cache counter sees the hit) and its answer equals HF's
question-agnostic run over the creator's kept entries.
"""

from __future__ import annotations

import json

import pytest
import torch
from reference_checks import (
    assert_agrees_along_the_run,
    assert_vllm_sides_with_the_eviction,
    logprob_gap,
    tokens_and_logprobs,
)
from test_chunked_prefill_reference import NEW_TOKENS, generate, story_prompt, wait_for_zero_usage
from test_kept_context_server import agnostic_teacher_forced
from test_prefix_caching_server import shared_prefix

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.server_process import VLLMServer
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.request_settings import RequestSettings

pytestmark = [pytest.mark.e2e, pytest.mark.model]

PROMPT_TOKENS, BUDGET, LAYERS, HEADS = 1100, 0.25, 30, 3  # SmolLM2-135M
FIRST_STEPS = 16
#: I = 384 tokens per head between chunks (>= B' = 288 of this prompt): evictions after 512, 768 and 1024
EVICTION = {"budget_scope": "model", "prefill": "chunked", "chunk_budget": 384}
SERVER_ARGS = (
    "--kv-eviction", "kvzap", "--kv-budget", str(BUDGET), "--block-size", "32",
    "--kv-eviction-config", json.dumps(EVICTION),
    "--max-model-len", "2048", "--max-num-batched-tokens", "256",
)  # fmt: skip
KEEP = {"kv_context": "keep", "kv_prefill": "whole", "kv_budget": 0.1}
CONTEXTS = "vllm_kvevict_kept_contexts_total"
HITS = "vllm:prefix_cache_hits_total"
BLOCK_SIZE = 32


def keep_and_read(server: VLLMServer, document: list[int], question: list[int]) -> dict:
    """The creator (the document alone, one token), then a reader (document + question, 64 greedy tokens with
    log-probabilities): its tokens, and the kept-context counters and prefix-cache hits after each."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="unused", timeout=900, max_retries=0)
    body = {"vllm_xargs": KEEP, "ignore_eos": True, "return_tokens_as_token_ids": True}
    seen = {}
    for label, prompt, tokens in (("creator", document, 1), ("reader", document + question, 64)):
        before = server.metric_value(HITS)
        result = client.completions.create(
            model=server.served_model_name, prompt=prompt, max_tokens=tokens, temperature=0, logprobs=1,
            extra_body=body,
        )  # fmt: skip
        contexts = {sample[0]["event"]: sample[1] for sample in server.metric_samples(CONTEXTS)}
        seen[label] = (contexts, server.metric_value(HITS) - before)
    return {"counters": seen, "reader": tokens_and_logprobs(result.choices[0].logprobs)}


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory) -> dict:
    from vllm_kvevict.hf_reference.chunked import teacher_forced_after_chunks
    from vllm_kvevict.hf_reference.model import load_reference_model
    from vllm_kvevict.policies.base import KeptTokens

    dump_dir = tmp_path_factory.mktemp("pooled-chunks")
    model, tokenizer = load_reference_model(model_dir, dtype=torch.float32)
    prompt_ids = story_prompt(tokenizer, PROMPT_TOKENS, seed=5)
    others = [
        (story_prompt(tokenizer, 60, seed=6), {"vllm_xargs": {"kv_eviction": "none"}}),
        (story_prompt(tokenizer, 700, seed=7), {}),
    ]
    document = shared_prefix(tokenizer, 1500)[:1500]  # 46 blocks and 28 tokens: the context is 1472
    question = tokenizer("\nHow many boxes are on shelf 12? Answer:")["input_ids"]
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, env={DEBUG_DUMP_ENV: str(dump_dir)}) as server:
        tokens, vllm_logprobs = generate(server, prompt_ids, {}, others)
        kept_context = keep_and_read(server, document, question)
        usage_after = wait_for_zero_usage(server)
    records = [torch.load(path) for path in dump_dir.glob("*.pt")]
    (record,) = [r for r in records if r["prompt_len"] == len(prompt_ids)]
    context_len = BLOCK_SIZE * (len(document) // BLOCK_SIZE)
    (creator,) = [r for r in records if r["prompt_len"] == context_len]
    # computed in chunks: the record holds the prompt's tail (after the context) after each head's entries
    tail = len(document) - context_len
    creator_kept = [
        KeptTokens(torch.where(i < context_len, i, -1), c - tail)
        for i, c in zip(creator["indices"], creator["counts"], strict=True)
    ]
    reader_tokens, reader_logprobs = kept_context["reader"]
    context_everything = [KeptTokens.everything(HEADS, context_len) for _ in creator_kept]

    def over_context(kept: list[KeptTokens]) -> torch.Tensor:
        return agnostic_teacher_forced(model, document + question, context_len, reader_tokens, kept)

    chunks = [(end, [KeptTokens(p, c) for p, c in held]) for end, held in record["chunks"]]
    final = [KeptTokens(i, c) for i, c in zip(record["indices"], record["counts"], strict=True)]
    everything = [KeptTokens.everything(HEADS, len(prompt_ids)) for _ in final]
    return {
        "prompt_len": len(prompt_ids),
        "record": record,
        "tokens": tokens,
        "vllm_logprobs": vllm_logprobs,
        "masked": teacher_forced_after_chunks(model, prompt_ids, chunks, final, tokens),
        "full": teacher_forced_after_chunks(model, prompt_ids, [], everything, tokens),
        "usage_after": usage_after,
        "context": {
            "length": context_len,
            "counters": kept_context["counters"],
            "kept": creator_kept,
            "tokens": reader_tokens,
            "logprobs": reader_logprobs,
            "masked": over_context(creator_kept),
            "full": over_context(context_everything),
        },
    }


def test_each_eviction_keeps_the_rules_total_shared_unevenly_by_layers_and_heads(run: dict) -> None:
    schedule = {"prefill": EVICTION["prefill"], "chunk_budget": EVICTION["chunk_budget"]}
    params = {"budget_scope": EVICTION["budget_scope"]}
    config = EvictionConfig.from_dict({"method": "kvzap", "budget": BUDGET, "params": params, **schedule})
    plan = RequestSettings(config, 32, LAYERS).plan_for(run["prompt_len"])
    ends = [end for end, _ in run["record"]["chunks"]]
    assert ends == [512, 768, 1024], ends
    for end, held in run["record"]["chunks"]:
        counts = torch.stack([c for _, c in held])  # [L, H]
        assert int(counts.sum()) == LAYERS * HEADS * plan.kept_length_at(end)
        assert len(set(counts.flatten().tolist())) > 1, "the layers' and heads' shares differ"
    final = torch.stack(run["record"]["counts"])
    assert int(final.sum()) == HEADS * sum(plan.layer_budgets)


def test_decoding_matches_hf_hiding_what_each_chunk_evicted(run: dict) -> None:
    assert len(run["tokens"]) == NEW_TOKENS
    gap = logprob_gap(run["vllm_logprobs"], run["tokens"], run["masked"])
    assert float(gap[:FIRST_STEPS].max()) < 0.2, f"first steps |delta logprob| {gap[:FIRST_STEPS].tolist()}"
    assert float(gap.mean()) < 0.03 and float(gap.max()) < 0.6, f"mean {gap.mean():.4f} max {gap.max():.4f}"


def test_vllm_follows_the_chunkwise_reference_where_eviction_changes_the_output(run: dict) -> None:
    assert_vllm_sides_with_the_eviction(
        run["vllm_logprobs"], run["tokens"], run["masked"], run["full"], min_moved=5
    )


def test_every_block_is_back_after_the_traffic(run: dict) -> None:
    assert run["usage_after"] == 0.0


def test_a_context_kept_across_layers_is_read_from_its_entry(run: dict) -> None:
    context = run["context"]
    creator, reader = context["counters"]["creator"], context["counters"]["reader"]
    assert creator == ({"kept": 1.0, "read": 0.0}, 0)
    assert reader == ({"kept": 1.0, "read": 1.0}, context["length"])  # vLLM's own counter sees the hit
    counts = torch.stack([k.counts for k in context["kept"]])  # [L, H]
    assert bool((counts % BLOCK_SIZE == 0).all()), "every (layer, head) keeps whole blocks"
    assert len(set(counts.sum(dim=1).tolist())) > 1, "the layers' shares differ"
    config = EvictionConfig.from_dict({"method": "kvzap", "budget": 0.1, "params": {"budget_scope": "model"}})
    plan = RequestSettings(config, BLOCK_SIZE, LAYERS).plan_for(context["length"])
    assert int(counts.sum()) == LAYERS * HEADS * plan.kept_bound


def test_a_readers_answer_equals_hf_over_the_creators_entries_ranked_across_layers(run: dict) -> None:
    context = run["context"]
    first = logprob_gap(context["logprobs"], context["tokens"], context["masked"])[:8]
    assert float(first[0]) < 0.25, f"first step |delta logprob| {first.tolist()}"
    assert_agrees_along_the_run(context["logprobs"], context["tokens"], context["masked"])
    assert_vllm_sides_with_the_eviction(
        context["logprobs"], context["tokens"], context["masked"], context["full"], min_moved=5
    )
