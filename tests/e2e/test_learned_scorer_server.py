"""The learned scorer served (``--kv-eviction ada-kvzap``) by a real ``vllm serve`` of the bundled model,
through HTTP and the ``openai`` client.

Two servers, one after the other (prefix caching on; the worker saves what each compacted request kept,
``KVEVICT_DEBUG_DUMP_DIR``):

- the shipped scorer (no ``--kv-eviction-config``: the packaged scorer of the bundled model): it answers,
  compacts each request to its plan and frees the blocks; a context kept by one request (``kv_context:
  "keep"``, Ada-KV's head budgets in whole blocks) is read by the next; a request
  asking for per-chunk eviction is served, because the shipped scorer scores each head from its own head's
  features alone (``scores_each_head_alone``; a scorer reading every head is refused per chunk,
  checked in ``tests/unit/settings/test_learned_requests.py`` and
  ``tests/unit/adapter/test_learned_scorer_startup.py``);
- the shipped MLP scorer named with ``--kv-eviction-config '{"scorer": DIR}'``, vLLM's chunks of 512 tokens:
  a prompt evicted chunk by chunk keeps at layer 0 (whose entries do not depend on what earlier chunks kept)
  what the same prompt evicted whole keeps.

These tests check the mechanics, never the answers' quality.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from request_bodies import client_of, ignore_eos_body
from test_prefix_caching_server import shared_prefix

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.layout.accounting import plan_request
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.policies.surrogate_scorer import PACKAGED_SCORERS
from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BLOCK_SIZE, BUDGET, NUM_LAYERS = 32, 0.25, 30  # SmolLM2-135M
COMMON_ARGS = ("--kv-eviction", "ada-kvzap", "--kv-budget", str(BUDGET), "--block-size", str(BLOCK_SIZE),
               "--max-model-len", "4096")  # fmt: skip
COMPACTED = "vllm_kvevict_requests_compacted_total"
FREED = "vllm_kvevict_blocks_freed_total"
CONTEXTS = "vllm_kvevict_kept_contexts_total"
HITS = "vllm:prefix_cache_hits_total"
SHIPPED_MLP = "smollm2-135m-instruct-mlp"
USAGE = "vllm:kv_cache_usage_perc"


@dataclass
class Served:
    """What each request of one server did, by label, and the server's state at the end."""

    answers: dict[str, str] = field(default_factory=dict)
    completion_tokens: dict[str, int] = field(default_factory=dict)
    prompt_lens: dict[str, int] = field(default_factory=dict)
    compacted: dict[str, dict[str, float]] = field(default_factory=dict)  # compacted requests per method
    freed: dict[str, float] = field(default_factory=dict)  # blocks freed by the request
    contexts: dict[str, dict[str, float]] = field(default_factory=dict)  # kept/read counters after it
    hits: dict[str, float] = field(default_factory=dict)  # prefix-cache hit tokens it added
    dumps: dict[str, dict | None] = field(default_factory=dict)  # what the worker saved of it
    refusals: dict[str, str] = field(default_factory=dict)  # a 400's message
    usage: float = -1.0
    log: str = ""


@dataclass
class Session:
    server: VLLMServer
    dump_dir: Path
    served: Served = field(default_factory=Served)

    def ask(self, label: str, prompt: list[int], max_tokens: int, xargs: dict | None = None, salt: str = ""):
        from openai import BadRequestError

        server, served = self.server, self.served
        freed, hits = server.metric_value(FREED), server.metric_value(HITS)
        dumped = set(self.dump_dir.glob("*.pt"))
        body = ignore_eos_body(xargs, **({"cache_salt": salt} if salt else {}))
        try:
            result = client_of(server, timeout_s=900).completions.create(
                model=server.served_model_name,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                extra_body=body,
            )
        except BadRequestError as exc:
            served.refusals[label] = str(exc)
            return
        new = set(self.dump_dir.glob("*.pt")) - dumped
        served.dumps[label] = torch.load(new.pop()) if len(new) == 1 else None
        served.answers[label] = result.choices[0].text
        served.completion_tokens[label] = result.usage.completion_tokens
        served.prompt_lens[label] = result.usage.prompt_tokens
        served.compacted[label] = sum_by_method(server)
        served.freed[label] = server.metric_value(FREED) - freed
        served.hits[label] = server.metric_value(HITS) - hits
        served.contexts[label] = {s[0]["event"]: s[1] for s in server.metric_samples(CONTEXTS)}


def sum_by_method(server: VLLMServer) -> dict[str, float]:
    totals: dict[str, float] = {}
    for labels, value in server.metric_samples(COMPACTED):
        totals[labels.get("method", "")] = totals.get(labels.get("method", ""), 0.0) + value
    return totals


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def story(tokenizer, num_tokens: int) -> list[int]:
    return tokenizer("Once upon a time, in a quiet village by the sea, " * 200)["input_ids"][:num_tokens]


def serving(model_dir, dump_dir: Path, extra_args: tuple[str, ...]) -> Iterator[Session]:
    with VLLMServer(
        model_dir, extra_args=COMMON_ARGS + extra_args, env={DEBUG_DUMP_ENV: str(dump_dir)}
    ) as server:
        session = Session(server, dump_dir)
        yield session
        session.served.usage = server.wait_for_metric(USAGE, 0.0)
        session.served.log = server.log_path.read_text()


@pytest.fixture(scope="module")
def shipped(model_dir, tmp_path_factory, tokenizer) -> Served:
    """The packaged scorer: a request, a kept context and its reader, a per-chunk request."""
    document = shared_prefix(tokenizer, 1500)[:1500]
    question = tokenizer("\nHow many boxes are on shelf 12? Answer:")["input_ids"]
    for session in serving(model_dir, tmp_path_factory.mktemp("shipped"), ()):
        session.ask("story", story(tokenizer, 1200), 32)
        session.ask("creator", document, 1, {"kv_context": "keep"})
        session.ask("reader", document + question, 16, {"kv_context": "keep"})
        session.ask("chunked", story(tokenizer, 1200), 4, {"kv_prefill": "chunked"})
    return session.served


@pytest.fixture(scope="module")
def per_head(model_dir, tmp_path_factory, tokenizer) -> Served:
    """The shipped MLP scorer (heads score alone), named: one prompt evicted whole, then chunk by chunk."""
    scorer = PACKAGED_SCORERS / SHIPPED_MLP
    args = ("--kv-eviction-config", json.dumps({"scorer": str(scorer)}), "--max-num-batched-tokens", "512")
    prompt = story(tokenizer, 2000)
    for session in serving(model_dir, tmp_path_factory.mktemp("per-head"), args):
        session.ask("whole", prompt, 4, {"kv_eviction": "kvzap"}, salt="whole")
        session.ask("chunked", prompt, 4, {"kv_eviction": "kvzap", "kv_prefill": "chunked"}, salt="chunked")
    return session.served


def test_ada_kvzap_answers_compacts_to_its_plan_and_frees_blocks(shipped: Served):
    assert shipped.completion_tokens["story"] == 32 and shipped.answers["story"].strip()
    assert shipped.compacted["story"].get("ada-kvzap") == 1.0
    prompt_len = shipped.prompt_lens["story"]
    plan = plan_request(prompt_len, BUDGET, BLOCK_SIZE, build_policy("ada-kvzap"), NUM_LAYERS)
    assert plan.compacts
    kept = [counts.tolist() for counts in shipped.dumps["story"]["counts"]]
    assert [sum(heads) / len(heads) for heads in kept] == list(plan.layer_budgets)
    assert any(len(set(heads)) > 1 for heads in kept)  # Ada-KV's per-head allocation of the scores
    assert shipped.freed["story"] > 0
    assert shipped.usage == 0.0  # every block came back
    # with no --kv-eviction-config the server scores with the packaged scorer of the bundled model
    assert "kv-eviction: ada-kvzap scores with " in shipped.log
    assert "vllm_kvevict/scorers/smollm2-135m-instruct-" in shipped.log


def test_a_context_kept_with_ada_kv_is_read_by_the_next_request(shipped: Served):
    assert shipped.contexts["creator"] == {"kept": 1.0, "read": 0.0}
    assert shipped.compacted["creator"].get("ada-kvzap") == 2.0  # the story, then the creator (Ada-KV)
    context_len = BLOCK_SIZE * (1500 // BLOCK_SIZE)
    creator = shipped.dumps["creator"]
    assert creator["prompt_len"] == context_len
    totals = {int(counts.sum()) for counts in creator["counts"]}
    assert len(totals) == 1  # every layer the same total, each head whole blocks
    assert all(bool((counts % BLOCK_SIZE == 0).all()) for counts in creator["counts"])
    assert shipped.contexts["reader"] == {"kept": 1.0, "read": 1.0}
    assert shipped.hits["reader"] == context_len  # vLLM's prefix cache served the kept blocks
    assert shipped.completion_tokens["reader"] == 16


def test_per_chunk_eviction_with_the_shipped_scorer_is_served(shipped: Served):
    assert "chunked" not in shipped.refusals
    assert shipped.completion_tokens["chunked"] == 4 and shipped.answers["chunked"].strip()
    # after the story and the kept context's creator, both ada-kvzap
    assert shipped.compacted["chunked"].get("ada-kvzap") == shipped.compacted["creator"]["ada-kvzap"] + 1
    assert shipped.freed["chunked"] > 0


def test_chunk_by_chunk_keeps_at_layer_0_what_the_whole_prompt_keeps(per_head: Served):
    assert f"kv-eviction: ada-kvzap scores with {PACKAGED_SCORERS / SHIPPED_MLP}" in per_head.log
    whole, chunked = per_head.dumps["whole"], per_head.dumps["chunked"]
    assert whole["prompt_len"] == chunked["prompt_len"] == 2000  # B = 500, I = 750, chunks of 512
    assert not whole["chunks"] and chunked["chunks"]  # only the second was evicted between chunks
    assert [c.tolist() for c in chunked["counts"]] == [c.tolist() for c in whole["counts"]]
    assert torch.equal(chunked["indices"][0], whole["indices"][0])
    assert per_head.compacted["chunked"]["kvzap"] == per_head.compacted["whole"]["kvzap"] + 1
    assert per_head.usage == 0.0
