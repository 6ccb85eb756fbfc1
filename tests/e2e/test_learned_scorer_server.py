"""The learned scorer served (``--kv-eviction ada-kvzap``) by a real ``vllm serve`` of the bundled model,
through HTTP and the ``openai`` client: it answers, compacts each request to its plan and frees the blocks,
a context kept by one request (``kv_context: "keep"``: run as ``kvzap``, the same scores with every head
the same count) is read by the next, and a prompt evicted chunk by chunk (``kv_prefill: "chunked"``) keeps
at layer 0 (whose entries do not depend on what earlier chunks kept) what the same prompt evicted whole keeps.

The scorer is a random-weight one of the bundled model's shapes and fingerprint, written by the fixture and
named with ``--kv-eviction-config '{"scorer": DIR}'``: these tests check the mechanics, never the answers'
quality. One server (prefix caching on, for the kept context; vLLM's chunks of 512 tokens; the worker saves
what each compacted request kept, ``KVEVICT_DEBUG_DUMP_DIR``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from learned_scorers import write_scorer_for
from test_prefix_caching_server import shared_prefix

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.layout.accounting import plan_request
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BLOCK_SIZE, BUDGET, NUM_LAYERS = 32, 0.25, 30  # SmolLM2-135M
COMPACTED = "vllm_kvevict_requests_compacted_total"
FREED = "vllm_kvevict_blocks_freed_total"
CONTEXTS = "vllm_kvevict_kept_contexts_total"
HITS = "vllm:prefix_cache_hits_total"
USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class Served:
    answers: dict[str, str]
    completion_tokens: dict[str, int]
    prompt_lens: dict[str, int]
    compacted: dict[str, dict[str, float]]  # per request: compacted requests per method after it
    freed: dict[str, float]  # blocks freed by each request
    contexts: dict[str, dict[str, float]]  # kept/read counters after each request
    hits: dict[str, float]  # prefix-cache hit tokens each request added
    dumps: dict[str, dict]  # per request: what the worker saved of it (kept indices and counts, chunks)
    usage: float
    context_len: int
    log: str  # the server's log


def sum_by_method(server: VLLMServer) -> dict[str, float]:
    totals: dict[str, float] = {}
    for labels, value in server.metric_samples(COMPACTED):
        totals[labels.get("method", "")] = totals.get(labels.get("method", ""), 0.0) + value
    return totals


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory) -> Served:
    from openai import OpenAI
    from transformers import AutoConfig, AutoTokenizer

    scorer = write_scorer_for(AutoConfig.from_pretrained(model_dir), tmp_path_factory.mktemp("scorer"))
    dump_dir: Path = tmp_path_factory.mktemp("kept")
    args = (
        "--kv-eviction", "ada-kvzap",
        "--kv-budget", str(BUDGET),
        "--kv-eviction-config", json.dumps({"scorer": str(scorer)}),
        "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "4096",
        "--max-num-batched-tokens", "512",
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    document = shared_prefix(tokenizer, 1500)[:1500]
    question = tokenizer("\nHow many boxes are on shelf 12? Answer:")["input_ids"]
    story = tokenizer("Once upon a time, in a quiet village by the sea, " * 200)["input_ids"][:2000]
    record: dict[str, dict] = {
        k: {} for k in ("answers", "tokens", "lens", "compacted", "freed", "ctx", "hits", "dumps")
    }
    with VLLMServer(model_dir, extra_args=args, env={DEBUG_DUMP_ENV: str(dump_dir)}) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=900, max_retries=0)

        def ask(label: str, prompt: list[int], max_tokens: int, xargs: dict | None = None, salt: str = ""):
            freed, hits = server.metric_value(FREED), server.metric_value(HITS)
            dumped = set(dump_dir.glob("*.pt"))
            body: dict = {"ignore_eos": True, **({"vllm_xargs": xargs} if xargs else {})}
            if salt:
                body["cache_salt"] = salt
            result = client.completions.create(
                model=server.served_model_name,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                extra_body=body,
            )
            new = set(dump_dir.glob("*.pt")) - dumped
            record["dumps"][label] = torch.load(new.pop()) if len(new) == 1 else None
            record["answers"][label] = result.choices[0].text
            record["tokens"][label] = result.usage.completion_tokens
            record["lens"][label] = result.usage.prompt_tokens
            record["compacted"][label] = sum_by_method(server)
            record["freed"][label] = server.metric_value(FREED) - freed
            record["hits"][label] = server.metric_value(HITS) - hits
            record["ctx"][label] = {s[0]["event"]: s[1] for s in server.metric_samples(CONTEXTS)}

        ask("story", story, 32)
        ask("creator", document, 1, {"kv_context": "keep"})
        ask("reader", document + question, 16, {"kv_context": "keep"})
        ask("whole", story, 4, {"kv_eviction": "kvzap"}, salt="whole")
        ask("chunked", story, 4, {"kv_eviction": "kvzap", "kv_prefill": "chunked"}, salt="chunked")
        usage = server.wait_for_metric(USAGE, 0.0)
        log = server.log_path.read_text()
    return Served(
        answers=record["answers"],
        completion_tokens=record["tokens"],
        prompt_lens=record["lens"],
        compacted=record["compacted"],
        freed=record["freed"],
        contexts=record["ctx"],
        hits=record["hits"],
        dumps=record["dumps"],
        usage=usage,
        context_len=BLOCK_SIZE * (len(document) // BLOCK_SIZE),
        log=log,
    )


def test_ada_kvzap_answers_compacts_to_its_plan_and_frees_blocks(served: Served):
    assert served.completion_tokens["story"] == 32 and served.answers["story"].strip()
    assert served.compacted["story"].get("ada-kvzap") == 1.0
    prompt_len = served.prompt_lens["story"]
    plan = plan_request(prompt_len, BUDGET, BLOCK_SIZE, build_policy("ada-kvzap"), NUM_LAYERS)
    assert plan.compacts
    kept = [counts.tolist() for counts in served.dumps["story"]["counts"]]
    assert [sum(heads) / len(heads) for heads in kept] == list(plan.layer_budgets)
    assert any(len(set(heads)) > 1 for heads in kept)  # Ada-KV's per-head allocation of the scores
    assert served.freed["story"] > 0
    assert served.usage == 0.0  # every block came back
    assert "kv-eviction: ada-kvzap scores with " in served.log  # the scorer the server named


def test_a_context_kept_as_kvzap_is_read_by_the_next_request(served: Served):
    assert served.contexts["creator"] == {"kept": 1.0, "read": 0.0}
    assert served.compacted["creator"].get("kvzap") == 1.0  # ada-kvzap keeping a context runs as kvzap
    creator = served.dumps["creator"]
    assert creator["prompt_len"] == served.context_len
    assert len({int(c) for counts in creator["counts"] for c in counts}) == 1  # every head and layer alike
    assert served.contexts["reader"] == {"kept": 1.0, "read": 1.0}
    assert served.hits["reader"] == served.context_len  # vLLM's prefix cache served the kept blocks
    assert served.completion_tokens["reader"] == 16


def test_chunk_by_chunk_keeps_at_layer_0_what_the_whole_prompt_keeps(served: Served):
    whole, chunked = served.dumps["whole"], served.dumps["chunked"]
    assert whole["prompt_len"] == chunked["prompt_len"] == 2000  # B = 500, I = 750, chunks of 512
    assert not whole["chunks"] and chunked["chunks"]  # only the second was evicted between chunks
    assert [c.tolist() for c in chunked["counts"]] == [c.tolist() for c in whole["counts"]]
    assert torch.equal(chunked["indices"][0], whole["indices"][0])
    assert served.compacted["chunked"]["kvzap"] == served.compacted["whole"]["kvzap"] + 1
