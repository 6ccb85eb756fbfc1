"""A budget pooled across layers, served: ``vllm serve --kv-eviction kvzap --kv-budget 0.25
--kv-eviction-config '{"budget_scope": "model", ...}'`` ranks every layer's entries of a prompt together, and
the request's kept blocks hold every layer's sub-blocks (``docs/design_modes.md``, "Per-layer block
budgets"). One server (chunked prefill and prefix caching on, as it starts; evictions between chunks at
multiples of 256 tokens, ``chunk_stride``), ``KVEVICT_DEBUG_DUMP_DIR`` set, three runs:

- **A whole prompt** (1100 tokens in one step, the server's ``prefill: whole``), batched with neighbours that
  prefill and compact while it decodes. Checked: the plan's exact total over all layers, layers keeping
  different shares, the largest layer keeping more entries per head than the blocks the scheduler left could
  hold with per-layer pools; HF transformers (float32) keeps the same (layer, head, token) entries and is fed
  vLLM's tokens: every step's log-probability agrees within bf16 tolerance over 256 steps that cross
  sub-block boundaries at different steps in different layers; a full-cache HF run is the control (vLLM
  must side with the masked run where the two differ).
- **Chunk by chunk** (``kv_prefill: "chunked"``): an 1100-token prompt evicted after 512, 768 and 1024 tokens
  (each a ranking of every layer's held entries, read back from sub-blocks in any layer's region) and after
  its last chunk, while a short uncompacted request and another chunked one share its steps. The dump records
  what every (layer, KV head) held after each evicting chunk; HF prefills the same prompt segment by segment
  with exactly those entries hidden, then teacher-forces vLLM's tokens with the final kept sets.
- **A kept context** (``kv_context: "keep"``, 10 %): its creator (1500 tokens, its last 28 after the context)
  keeps every (layer, head) count in whole blocks; a reader starts from the entry (vLLM's prefix-cache counter
  sees the hit) and its answer equals HF's question-agnostic run over the creator's kept entries.
- **A shared prefix**: a prompt starting with the 768 tokens the whole prompt published (its first 24
  blocks, the ones its compaction freed) reads them from vLLM's prefix cache, keeps them whole in every layer
  and ranks only its own ~500 tokens across layers (the private plan's total); HF keeps the same entries, the
  prefix whole, and agrees along 64 teacher-forced steps, closer than the full cache does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference_checks import (
    assert_agrees_along_the_run,
    assert_vllm_sides_with_the_eviction,
    logprob_gap,
    tokens_and_logprobs,
)
from test_chunked_prefill_reference import NEW_TOKENS, generate, story_prompt
from test_compacted_attention_reference import generate_in_vllm, teacher_forced, travel_prompt
from test_kept_context_server import agnostic_teacher_forced
from test_prefix_caching_server import shared_prefix

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.layout.accounting import plan_request
from vllm_kvevict.policies.base import KeptTokens
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.server_process import VLLMServer
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.request_settings import RequestSettings

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BUDGET, BLOCK_SIZE, LAYERS, HEADS = 0.25, 32, 30, 3  # SmolLM2-135M
PROMPT_TOKENS = 1100
SHARED, OWN = 768, 500  # the whole prompt's blocks its compaction freed (published), then a story's tokens
FIRST_STEPS = 16
#: I = 384 tokens per head between chunks (>= B' = 288 of an 1100-token prompt), evictions at multiples of
#: 256 computed tokens (vLLM's steps take up to 2048): after 512, 768 and 1024
EVICTION = {"budget_scope": "model", "chunk_budget": 384, "chunk_stride": 256}
SERVER_ARGS = (
    "--kv-eviction", "kvzap", "--kv-budget", str(BUDGET), "--block-size", str(BLOCK_SIZE),
    "--kv-eviction-config", json.dumps(EVICTION),
    "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
)  # fmt: skip
CHUNKED = {"kv_prefill": "chunked"}
KEEP = {"kv_context": "keep", "kv_budget": 0.1}
CONTEXTS = "vllm_kvevict_kept_contexts_total"
HITS = "vllm:prefix_cache_hits_total"
USAGE = "vllm:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pooled")


@pytest.fixture(scope="module")
def server(model_dir, dump_dir):
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, env={DEBUG_DUMP_ENV: str(dump_dir)}) as running:
        yield running


@pytest.fixture(scope="module")
def hf(model_dir):
    from vllm_kvevict.hf_reference.model import load_reference_model

    return load_reference_model(model_dir, dtype=torch.float32)


def new_records(dump_dir: Path, before: set[Path], prompt_len: int) -> dict:
    """The one record of a ``prompt_len``-token prompt the worker dumped since ``before``."""
    records = [torch.load(path) for path in set(dump_dir.glob("*.pt")) - before]
    (record,) = [r for r in records if r["prompt_len"] == prompt_len]
    return record


def kept_of(record: dict) -> list[KeptTokens]:
    return [KeptTokens(i, c) for i, c in zip(record["indices"], record["counts"], strict=True)]


@pytest.fixture(scope="module")
def whole(server, dump_dir, hf) -> dict:
    model, tokenizer = hf
    prompt_ids = travel_prompt(tokenizer, PROMPT_TOKENS)
    neighbours = [travel_prompt(tokenizer, 60, seed=1), travel_prompt(tokenizer, 700, seed=2)]
    before = set(dump_dir.glob("*.pt"))
    tokens, vllm_logprobs = generate_in_vllm(server, prompt_ids, neighbours, new_tokens=256)
    kept = kept_of(new_records(dump_dir, before, len(prompt_ids)))
    everything = [KeptTokens.everything(HEADS, len(prompt_ids)) for _ in kept]
    return {
        "prompt_ids": prompt_ids,
        "tokens": tokens,
        "vllm_logprobs": vllm_logprobs,
        "counts": torch.stack([k.counts for k in kept]),  # [L, H]
        "masked": teacher_forced(model, prompt_ids, tokens, kept),
        "full": teacher_forced(model, prompt_ids, tokens, everything),
    }


@pytest.fixture(scope="module")
def chunked(server, dump_dir, hf, whole) -> dict:
    from vllm_kvevict.hf_reference.chunked import teacher_forced_after_chunks

    model, tokenizer = hf
    prompt_ids = story_prompt(tokenizer, PROMPT_TOKENS, seed=5)
    others = [
        (story_prompt(tokenizer, 60, seed=6), {"vllm_xargs": {"kv_eviction": "none"}}),
        (story_prompt(tokenizer, 700, seed=7), {"vllm_xargs": CHUNKED}),
    ]
    before = set(dump_dir.glob("*.pt"))
    tokens, vllm_logprobs = generate(server, prompt_ids, CHUNKED, others)
    record = new_records(dump_dir, before, len(prompt_ids))
    chunks = [(end, [KeptTokens(p, c) for p, c in held]) for end, held in record["chunks"]]
    final = kept_of(record)
    everything = [KeptTokens.everything(HEADS, len(prompt_ids)) for _ in final]
    return {
        "prompt_len": len(prompt_ids),
        "record": record,
        "tokens": tokens,
        "vllm_logprobs": vllm_logprobs,
        "masked": teacher_forced_after_chunks(model, prompt_ids, chunks, final, tokens),
        "full": teacher_forced_after_chunks(model, prompt_ids, [], everything, tokens),
    }


@pytest.fixture(scope="module")
def kept_context(server, dump_dir, hf, chunked) -> dict:
    """The creator (the document alone, one token), then a reader (document + question, 64 greedy tokens with
    log-probabilities); the kept-context counters and prefix-cache hits after each; every block back after."""
    from openai import OpenAI

    model, tokenizer = hf
    document = shared_prefix(tokenizer, 1500)[:1500]  # 46 blocks and 28 tokens: the context is 1472
    question = tokenizer("\nHow many boxes are on shelf 12? Answer:")["input_ids"]
    context_len = BLOCK_SIZE * (len(document) // BLOCK_SIZE)
    client = OpenAI(base_url=server.base_url, api_key="unused", timeout=900, max_retries=0)
    body = {"vllm_xargs": KEEP, "ignore_eos": True, "return_tokens_as_token_ids": True}
    before, seen = set(dump_dir.glob("*.pt")), {}
    for label, prompt, max_tokens in (("creator", document, 1), ("reader", document + question, 64)):
        hits = server.metric_value(HITS)
        result = client.completions.create(
            model=server.served_model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1,
            extra_body=body,
        )  # fmt: skip
        contexts = {sample[0]["event"]: sample[1] for sample in server.metric_samples(CONTEXTS)}
        seen[label] = (contexts, server.metric_value(HITS) - hits)
    usage_after = server.wait_for_metric(USAGE, 0.0, 60.0)
    tokens, logprobs = tokens_and_logprobs(result.choices[0].logprobs)
    kept = kept_of(new_records(dump_dir, before, context_len))
    everything = [KeptTokens.everything(HEADS, context_len) for _ in kept]

    def over_context(entries: list[KeptTokens]) -> torch.Tensor:
        return agnostic_teacher_forced(model, document + question, context_len, tokens, entries)

    return {
        "length": context_len,
        "counters": seen,
        "kept": kept,
        "tokens": tokens,
        "logprobs": logprobs,
        "masked": over_context(kept),
        "full": over_context(everything),
        "usage_after": usage_after,
    }


@pytest.fixture(scope="module")
def shared(server, dump_dir, hf, whole, kept_context) -> dict:
    """A prompt whose first SHARED tokens are the whole prompt's published blocks, then its own OWN."""
    model, tokenizer = hf
    prompt_ids = whole["prompt_ids"][:SHARED] + travel_prompt(tokenizer, OWN, seed=9)
    before, hits = set(dump_dir.glob("*.pt")), server.metric_value(HITS)
    tokens, vllm_logprobs = generate_in_vllm(server, prompt_ids, [], new_tokens=64)
    hit = server.metric_value(HITS) - hits
    own = kept_of(new_records(dump_dir, before, len(prompt_ids)))
    prefix = torch.arange(SHARED).expand(HEADS, -1)
    kept = [KeptTokens(torch.cat([prefix, k.indices], dim=1), k.counts + SHARED) for k in own]
    everything = [KeptTokens.everything(HEADS, len(prompt_ids)) for _ in kept]
    return {
        "prompt_len": len(prompt_ids),
        "hit": hit,
        "own": torch.stack([k.counts for k in own]),  # [L, H] entries of its own part
        "own_indices": own,
        "tokens": tokens,
        "vllm_logprobs": vllm_logprobs,
        "masked": teacher_forced(model, prompt_ids, tokens, kept),
        "full": teacher_forced(model, prompt_ids, tokens, everything),
        "usage_after": server.wait_for_metric(USAGE, 0.0, 60.0),
    }


def plan_for(prompt_len: int, budget: float, schedule: dict | None = None):
    params = {"budget_scope": "model"}
    raw = {"method": "kvzap", "budget": budget, "params": params, **(schedule or {})}
    config = EvictionConfig.from_dict(raw)
    return RequestSettings(config, BLOCK_SIZE, LAYERS).plan_for(prompt_len)


# ----- a whole prompt -------------------------------------------------------------------------------------
def test_the_kept_total_is_the_plans_and_layers_share_it_unevenly(whole: dict) -> None:
    prompt_len = len(whole["prompt_ids"])
    plan = plan_request(prompt_len, BUDGET, BLOCK_SIZE, build_policy("kvzap"), LAYERS)
    counts = whole["counts"]
    assert int(counts.sum()) == HEADS * sum(plan.layer_budgets)
    per_layer = counts.float().mean(dim=1)
    assert float(per_layer.max()) > 1.5 * float(per_layer.min())
    # The largest layer keeps more per head than the request's kept blocks hold in one layer's region: only
    # sub-blocks of other layers' regions make it fit.
    kept_blocks = -(-prompt_len // BLOCK_SIZE) - plan.blocks_to_free
    assert float(per_layer.max()) > kept_blocks * BLOCK_SIZE, (per_layer.tolist(), kept_blocks)


def test_decoding_matches_hf_keeping_the_same_entries(whole: dict) -> None:
    assert len(whole["tokens"]) == 256
    assert_agrees_along_the_run(whole["vllm_logprobs"], whole["tokens"], whole["masked"])


def test_vllm_follows_the_masked_reference_where_eviction_changes_the_output(whole: dict) -> None:
    assert_vllm_sides_with_the_eviction(
        whole["vllm_logprobs"], whole["tokens"], whole["masked"], whole["full"], min_moved=10
    )


# ----- chunk by chunk -------------------------------------------------------------------------------------
def test_each_eviction_keeps_the_rules_total_shared_unevenly_by_layers_and_heads(chunked: dict) -> None:
    plan = plan_for(chunked["prompt_len"], BUDGET, {"prefill": "chunked", "chunk_budget": 384})
    ends = [end for end, _ in chunked["record"]["chunks"]]
    assert ends == [512, 768, 1024], ends
    for end, held in chunked["record"]["chunks"]:
        counts = torch.stack([c for _, c in held])  # [L, H]
        assert int(counts.sum()) == LAYERS * HEADS * plan.kept_length_at(end)
        assert len(set(counts.flatten().tolist())) > 1, "the layers' and heads' shares differ"
    final = torch.stack(chunked["record"]["counts"])
    assert int(final.sum()) == HEADS * sum(plan.layer_budgets)


def test_decoding_matches_hf_hiding_what_each_chunk_evicted(chunked: dict) -> None:
    assert len(chunked["tokens"]) == NEW_TOKENS
    gap = logprob_gap(chunked["vllm_logprobs"], chunked["tokens"], chunked["masked"])
    assert float(gap[:FIRST_STEPS].max()) < 0.2, f"first steps |delta logprob| {gap[:FIRST_STEPS].tolist()}"
    assert float(gap.mean()) < 0.03 and float(gap.max()) < 0.6, f"mean {gap.mean():.4f} max {gap.max():.4f}"


def test_vllm_follows_the_chunkwise_reference_where_eviction_changes_the_output(chunked: dict) -> None:
    assert_vllm_sides_with_the_eviction(
        chunked["vllm_logprobs"], chunked["tokens"], chunked["masked"], chunked["full"], min_moved=5
    )


# ----- a kept context -------------------------------------------------------------------------------------
def test_a_context_kept_across_layers_is_read_from_its_entry(kept_context: dict) -> None:
    creator, reader = kept_context["counters"]["creator"], kept_context["counters"]["reader"]
    assert creator == ({"kept": 1.0, "read": 0.0}, 0)
    assert reader == ({"kept": 1.0, "read": 1.0}, kept_context["length"])  # vLLM's own counter sees the hit
    counts = torch.stack([k.counts for k in kept_context["kept"]])  # [L, H]
    assert bool((counts % BLOCK_SIZE == 0).all()), "every (layer, head) keeps whole blocks"
    assert len(set(counts.sum(dim=1).tolist())) > 1, "the layers' shares differ"
    assert int(counts.sum()) == LAYERS * HEADS * plan_for(kept_context["length"], 0.1).kept_bound
    assert kept_context["usage_after"] == 0.0  # every request of the module gave its blocks back


def test_a_readers_answer_equals_hf_over_the_creators_entries(kept_context: dict) -> None:
    first = logprob_gap(kept_context["logprobs"], kept_context["tokens"], kept_context["masked"])[:8]
    assert float(first[0]) < 0.25, f"first step |delta logprob| {first.tolist()}"
    assert_agrees_along_the_run(kept_context["logprobs"], kept_context["tokens"], kept_context["masked"])
    assert_vllm_sides_with_the_eviction(
        kept_context["logprobs"], kept_context["tokens"], kept_context["masked"], kept_context["full"],
        min_moved=5,
    )  # fmt: skip


# ----- a shared prefix ------------------------------------------------------------------------------------
def test_a_shared_prefix_is_read_from_the_cache_and_only_the_own_part_is_ranked(shared: dict) -> None:
    assert shared["hit"] == SHARED  # vLLM's own counter: the whole prompt published its freed blocks
    private = plan_for(shared["prompt_len"] - SHARED, BUDGET)
    assert private.compacts
    counts = shared["own"]
    assert int(counts.sum()) == HEADS * sum(private.layer_budgets)
    assert len(set(counts.sum(dim=1).tolist())) > 1, "the layers' shares differ"
    for kept in shared["own_indices"]:  # its own part only: the prefix is held whole, never ranked
        positions = kept.indices[kept.indices >= 0]
        assert int(positions.min()) >= SHARED and int(positions.max()) == shared["prompt_len"] - 1
    assert shared["usage_after"] == 0.0


def test_a_sharers_decoding_matches_hf_keeping_the_prefix_and_the_same_entries(shared: dict) -> None:
    assert len(shared["tokens"]) == 64
    assert_agrees_along_the_run(shared["vllm_logprobs"], shared["tokens"], shared["masked"])
    masked = logprob_gap(shared["vllm_logprobs"], shared["tokens"], shared["masked"])
    full = logprob_gap(shared["vllm_logprobs"], shared["tokens"], shared["full"])
    assert float(masked.mean()) < float(full.mean()), (masked.mean(), full.mean())  # the entries held decide
