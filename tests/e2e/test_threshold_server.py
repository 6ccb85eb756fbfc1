"""KVzap's threshold mode served by a real ``vllm serve`` of the bundled model (``--kv-eviction kvzap
--kv-budget 0.5 --kv-eviction-config '{"threshold": 1.0, "threshold_scope": "layer"}'``, the packaged
scorer and its per-layer score levels), through HTTP and the ``openai`` client, per layer and with the
budget pooled across layers (``"budget_scope": "model"``, a second server): the budget is a ceiling, each
layer keeps what its scores put above the threshold, and the scheduler frees the blocks the request's
largest layer (pooled: its mean layer) leaves once the worker has reported it.

One prompt computed in one step (whole-prompt compaction) and one in vLLM chunks of 512 (compacted after its
last chunk); on the pooled server also one evicted per chunk (``kv_prefill: "chunked"``, its own ``kv_budget``
0.2: after 1024 tokens, at most the rule's total, and after its last chunk). Each is streamed, and the
scheduler's saved-blocks gauge is read after every chunk until it goes past the ceiling's blocks (the
worker's report has arrived); then the client closes the stream (vLLM aborts the request), so a slow scrape
on a loaded machine cannot miss the decoding phase. The gauge must reach the blocks the worker's kept counts
leave (more than the ceiling's), and every block must come back at the end.
These tests check the mechanics, never the answers' quality."""

from __future__ import annotations

import json
import time

import pytest
import torch
from request_bodies import client_of, ignore_eos_body

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.layout.accounting import (
    RequestPlan,
    adaptive_kept_bound,
    first_block_for_bound,
    layer_kept_bound,
    plan_request,
    with_chunk_budget,
    with_kept_bound,
)
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.server_process import VLLMServer
from vllm_kvevict.settings.config import DEFAULT_CHUNK_BUDGET

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BLOCK_SIZE, CEILING, THRESHOLD, LAYERS, HEADS = 32, 0.5, 1.0, 30, 3  # SmolLM2-135M
SAVED = "vllm_kvevict_kv_blocks_saved"
USAGE = "vllm:kv_cache_usage_perc"
PROMPTS = {"one-step": 480, "chunked": 1400}
PER_CHUNK = 1400  # pooled server only: evicted between its 512-token chunks too (``kv_prefill: "chunked"``)
PER_CHUNK_BUDGET = 0.2  # its ceiling; between chunks the rule holds I = 512 (the floor): evicted after 1024
DECODE_LIMIT = 512  # tokens a request may generate before its stream is closed (2048 - 1400 fit)


def saved_blocks(server: VLLMServer) -> float:
    """The scheduler's saved-blocks gauge (absent until the first compacted request sets it: 0)."""
    return sum(value for _, value in server.metric_samples(SAVED))


def ceiling_plan(prompt_len: int, budget_scope: str, ceiling: float = CEILING) -> RequestPlan:
    """The plan the budget alone gives (what the scheduler frees before the worker reports its counts)."""
    policy = build_policy("kvzap", threshold=0.0, budget_scope=budget_scope)
    return plan_request(prompt_len, ceiling, BLOCK_SIZE, policy, LAYERS)


def saved_while_decoding(
    server: VLLMServer, prompt: list[int], budget_scope: str, xargs: dict | None = None
) -> tuple[str, int, float]:
    """(text, tokens streamed, the largest saved-blocks value read): the gauge is read after every streamed
    chunk until it exceeds the ceiling's blocks, once more after that, and then the stream is closed."""
    ceiling = float((xargs or {}).get("kv_budget", CEILING))
    above = ceiling_plan(len(prompt), budget_scope, ceiling).blocks_to_free
    deadline = time.monotonic() + 60.0
    while saved_blocks(server) and time.monotonic() < deadline:  # the previous request's blocks are back
        time.sleep(0.2)
    stream = client_of(server, timeout_s=900).completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=DECODE_LIMIT, temperature=0, stream=True,
        extra_body=ignore_eos_body(xargs, return_token_ids=True),
    )  # fmt: skip
    text, tokens, largest, reads_after = "", 0, 0.0, 0
    with stream:
        for chunk in stream:
            if not chunk.choices:
                continue
            text += chunk.choices[0].text
            tokens += len(chunk.choices[0].token_ids or ())
            largest = max(largest, saved_blocks(server))
            reads_after += largest > above
            if reads_after == 2:
                break
    return text, tokens, largest


@pytest.fixture(scope="module", params=["layer", "model"])
def served(request, model_dir, tmp_path_factory) -> dict:
    from transformers import AutoTokenizer

    scope = request.param
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = "In the harbour town the ferry left at seven and the market opened at nine. " * 120
    dump_dir = tmp_path_factory.mktemp(f"threshold-{scope}")
    config = {"threshold": THRESHOLD, "threshold_scope": "layer", "budget_scope": scope}
    args = ("--kv-eviction", "kvzap", "--kv-budget", str(CEILING), "--block-size", str(BLOCK_SIZE),
            "--kv-eviction-config", json.dumps(config),
            "--max-model-len", "2048",
            "--max-num-batched-tokens", "512")  # fmt: skip
    runs: dict = {"budget_scope": scope}
    with VLLMServer(model_dir, extra_args=args, env={DEBUG_DUMP_ENV: str(dump_dir)}) as server:
        requests = [(label, length, None) for label, length in PROMPTS.items()]
        if scope == "model":
            xargs = {"kv_prefill": "chunked", "kv_budget": PER_CHUNK_BUDGET}
            requests.append(("per-chunk", PER_CHUNK, xargs))
        for label, length, xargs in requests:
            before = set(dump_dir.glob("*.pt"))
            prompt = tokenizer(text)["input_ids"][:length]
            answer, tokens, saved = saved_while_decoding(server, prompt, scope, xargs)
            (dump,) = set(dump_dir.glob("*.pt")) - before  # written when the prompt was compacted
            runs[label] = {"answer": answer, "tokens": tokens, "saved": saved, "dump": torch.load(dump),
                           "log": server.log_tail(40)}
        runs["usage"] = server.wait_for_metric(USAGE, 0.0)
        runs["saved_after"] = saved_blocks(server)
    return runs


@pytest.mark.parametrize("label", list(PROMPTS))
def test_the_threshold_sets_each_layers_count_under_the_ceiling(served: dict, label: str) -> None:
    run = served[label]
    assert 0 < run["tokens"] <= DECODE_LIMIT and run["answer"].strip()
    dump = run["dump"]
    assert dump["prompt_len"] == PROMPTS[label]
    ceiling = ceiling_plan(PROMPTS[label], served["budget_scope"])
    totals = [int(counts.sum()) for counts in dump["counts"]]
    if ceiling.pooled:  # ranked across layers: a layer may keep more than the mean, the request no more
        assert sum(totals) <= HEADS * sum(ceiling.layer_budgets)
    else:
        assert max(totals) <= HEADS * ceiling.kept_bound
    assert len(set(totals)) > 1  # the scores, not the budget, set each layer's count
    assert any(len(set(counts.tolist())) > 1 for counts in dump["counts"])  # and each head's


@pytest.mark.parametrize("label", list(PROMPTS))
def test_the_scheduler_frees_the_blocks_the_reported_bound_leaves(served: dict, label: str) -> None:
    run, prompt_len = served[label], PROMPTS[label]
    ceiling = ceiling_plan(prompt_len, served["budget_scope"])
    totals = [int(counts.sum()) for counts in run["dump"]["counts"]]
    reported = with_kept_bound(ceiling, adaptive_kept_bound(ceiling, totals, HEADS))
    assert reported.blocks_to_free == first_block_for_bound(prompt_len, reported.kept_bound, BLOCK_SIZE)
    assert reported.blocks_to_free > ceiling.blocks_to_free
    if ceiling.pooled:  # the mean layer's bound, below the largest layer's: the pool holds every layer
        largest = max(layer_kept_bound(prompt_len, total, HEADS, BLOCK_SIZE) for total in totals)
        assert reported.kept_bound < largest
    # What the scheduler freed, read while it decoded (the server's log tail says why, if not).
    assert run["saved"] == reported.blocks_to_free, run["log"]


def test_pooled_per_chunk_holds_at_most_the_rules_total_between_chunks_and_frees_the_reported_bound(
    served: dict,
) -> None:
    if served["budget_scope"] != "model":
        pytest.skip("the threshold per chunk is served with the budget pooled across layers only")
    run = served["per-chunk"]
    assert 0 < run["tokens"] <= DECODE_LIMIT and run["answer"].strip()
    dump = run["dump"]
    assert dump["prompt_len"] == PER_CHUNK
    ceiling = ceiling_plan(PER_CHUNK, "model", PER_CHUNK_BUDGET)
    between = with_chunk_budget(ceiling, DEFAULT_CHUNK_BUDGET)
    assert [computed for computed, _ in dump["chunks"]] == [1024]  # evicted before its last chunk
    for computed, layers in dump["chunks"]:
        held = sum(int(counts.sum()) for _, counts in layers)
        assert 0 < held < LAYERS * HEADS * between.kept_length_at(computed) < LAYERS * HEADS * computed
    totals = [int(counts.sum()) for counts in dump["counts"]]
    assert sum(totals) <= HEADS * sum(ceiling.layer_budgets) and len(set(totals)) > 1
    reported = with_kept_bound(ceiling, adaptive_kept_bound(ceiling, totals, HEADS))
    assert reported.blocks_to_free > ceiling.blocks_to_free
    assert run["saved"] == reported.blocks_to_free, run["log"]


def test_every_block_comes_back(served: dict) -> None:
    assert served["usage"] == 0.0 and served["saved_after"] == 0.0
