"""A decode-time cap with the learned scorer (``--kv-decode-eviction kvzap``) in a real ``vllm serve`` of the
bundled model, with its shipped scorer, through HTTP and the ``openai`` client, with the budget pooled across
layers (``budget_scope: "model"``: every layer's held entries ranked together at each re-score,
``AcrossLayers`` in ``datapath/executor.py``) and KVzap's threshold on the prompt (``threshold: 1.0``, per
layer's score levels: the budget is a ceiling). The per-layer re-score runs through a real server in
``test_decode_eviction_server.py`` (other methods) and with this scorer through the worker's datapath
(``tests/unit/datapath/test_kvzap_decode_worker.py``; with a threshold, ``test_threshold_decode_worker.py``).

Two requests, one after the other, each capped on average over every layer and head, re-scored every block
(32 tokens):
- "whole": a 200-token prompt kept whole (``vllm_xargs kv_budget=1024``), so every eviction is the decode
  cap's (64 entries per KV head), generating 100 tokens;
- "threshold": a 480-token prompt under a ceiling of half of it, which keeps what scores above the
  threshold and reports its bound; its cap (``kv_decode_budget`` 160, between the bound and the ceiling)
  then re-scores on the rule of that bound (its own first re-score, later than the ceiling's), generating
  256 tokens.
The worker saves each request's kept prompt and each head's length right before every re-score
(``KVEVICT_DEBUG_DUMP_DIR``). Mechanics only: the answers' quality is not checked.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from request_bodies import client_of, ignore_eos_body

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.layout.accounting import (
    RequestPlan,
    adaptive_kept_bound,
    plan_request,
    with_decode_cap,
    with_kept_bound,
)
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BLOCK_SIZE, CAP, NUM_LAYERS, NUM_KV_HEADS = 32, 64, 30, 3  # SmolLM2-135M
PROMPT_TOKENS, OUTPUT_TOKENS, WHOLE = 200, 100, 1024
THRESHOLD_PROMPT, THRESHOLD_OUTPUT, CEILING, THRESHOLD_CAP = 480, 256, 0.5, 160
PROMPT_CONFIG = {"budget_scope": "model", "threshold": 1.0, "threshold_scope": "layer"}
SERVER_ARGS = (
    "--max-model-len", "1024", "--block-size", str(BLOCK_SIZE),
    "--kv-eviction", "kvzap", "--kv-budget", "64",
    "--kv-decode-eviction", "kvzap", "--kv-decode-budget", str(CAP),
    "--kv-eviction-config", json.dumps(PROMPT_CONFIG),
)  # fmt: skip
FREED = "vllm_kvevict_decode_blocks_freed_total"
RESCORES = "vllm_kvevict_decode_evictions_total"
FALLBACKS = "vllm_kvevict_policy_fallbacks_total"


def kvzap_total(server: VLLMServer, name: str) -> float:
    return sum(value for labels, value in server.metric_samples(name) if labels.get("method") == "kvzap")


def finished_dumps(dump_dir: Path, old: set[Path], timeout_s: float = 60.0) -> list[Path]:
    """The decode dumps in ``dump_dir`` but ``old``, waiting for the first: the worker saves a request's
    record in the step that tells it the request finished, which may run after the answer reached the
    client."""
    deadline = time.monotonic() + timeout_s
    while not (dumps := list(set(dump_dir.glob("*.decode.pt")) - old)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return dumps


@dataclass
class Capped:
    text: str
    completion_tokens: int
    rescores: float  # re-scores counted while it decoded (every layer of it each)
    freed: float  # blocks it gave back while decoding
    fallbacks: float
    dump: dict  # its decode record
    prompt_dump: dict | None  # what its compacted prompt kept (None: kept whole)
    log: str


def serve_capped(
    server: VLLMServer, dump_dir: Path, prompt: list[int], output_tokens: int, xargs: dict
) -> Capped:
    """One capped request (its ``vllm_xargs``), its counters' increments and its dumps."""
    before = {name: kvzap_total(server, name) for name in (RESCORES, FREED, FALLBACKS)}
    old = set(dump_dir.glob("*.pt"))
    result = client_of(server, timeout_s=900).completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=output_tokens, temperature=0,
        extra_body=ignore_eos_body(xargs),
    )  # fmt: skip
    dumps = finished_dumps(dump_dir, old)
    assert len(dumps) == 1, dumps
    prompt_dumps = set(dump_dir.glob("*.pt")) - old - set(dumps)
    return Capped(
        text=result.choices[0].text,
        completion_tokens=result.usage.completion_tokens,
        rescores=kvzap_total(server, RESCORES) - before[RESCORES],
        freed=kvzap_total(server, FREED) - before[FREED],
        fallbacks=kvzap_total(server, FALLBACKS) - before[FALLBACKS],
        dump=torch.load(dumps[0]),
        prompt_dump=torch.load(prompt_dumps.pop()) if prompt_dumps else None,
        log=Path(server.log_path).read_text(),
    )


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory) -> dict[str, Capped]:
    from transformers import AutoTokenizer

    dump_dir = tmp_path_factory.mktemp("learned-decode")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokens = tokenizer("The lighthouse keeper wrote in his log every night. " * 80)["input_ids"]
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, env={DEBUG_DUMP_ENV: str(dump_dir)}) as server:
        return {
            "whole": serve_capped(
                server, dump_dir, tokens[:PROMPT_TOKENS], OUTPUT_TOKENS, {"kv_budget": WHOLE}
            ),
            "threshold": serve_capped(
                server, dump_dir, tokens[-THRESHOLD_PROMPT:], THRESHOLD_OUTPUT,
                {"kv_budget": CEILING, "kv_decode_budget": THRESHOLD_CAP},
            ),  # fmt: skip
        }


@pytest.fixture(scope="module")
def capped(served: dict[str, Capped]) -> Capped:
    return served["whole"]


def whole_plan() -> RequestPlan:
    policy = build_policy("kvzap", **PROMPT_CONFIG)
    return with_decode_cap(plan_request(PROMPT_TOKENS, WHOLE, BLOCK_SIZE, policy, NUM_LAYERS), CAP, None)


def test_the_capped_request_answers(capped: Capped) -> None:
    assert capped.completion_tokens == OUTPUT_TOKENS and capped.text.strip()


def test_the_learned_scorer_re_scores_on_the_plans_schedule_without_falling_back(capped: Capped) -> None:
    plan = whole_plan()
    assert not plan.compacts  # kept whole: every eviction is the decode cap's
    expected = [t for t in range(1, OUTPUT_TOKENS) if plan.rescores_at(t)]
    assert len(expected) >= 3
    assert capped.dump["rescored_at"] == expected and capped.rescores == len(expected)
    assert capped.fallbacks == 0 and "failed on request" not in capped.log
    assert "kv-eviction: decode kvzap scores with " in capped.log


def test_blocks_are_freed_while_decoding_and_the_request_holds_the_ranked_total(capped: Capped) -> None:
    plan = whole_plan()
    assert capped.freed == plan.blocks_freed(OUTPUT_TOKENS - 1) > 0
    rescored, heads = capped.dump["rescored_at"], NUM_LAYERS * NUM_KV_HEADS
    for index, (t, per_layer) in enumerate(zip(rescored, capped.dump["lengths_before"], strict=True)):
        assert len(per_layer) == NUM_LAYERS and all(len(layer) == NUM_KV_HEADS for layer in per_layer)
        if not index:
            assert per_layer == [[PROMPT_TOKENS + t] * NUM_KV_HEADS] * NUM_LAYERS  # the whole prompt, held
            continue
        # every layer and head together: the last re-score's L·H·a(t), then the tokens written since
        since = t - rescored[index - 1]
        assert sum(map(sum, per_layer)) == heads * (plan.kept_length(rescored[index - 1]) + since), t
        assert len({length for layer in per_layer for length in layer}) > 1  # ranked, not capped per head


def test_a_thresholded_prompts_cap_re_scores_on_the_rule_of_its_reported_bound(served: dict) -> None:
    run = served["threshold"]
    assert run.completion_tokens == THRESHOLD_OUTPUT and run.text.strip()
    assert run.prompt_dump is not None and run.prompt_dump["prompt_len"] == THRESHOLD_PROMPT
    policy = build_policy("kvzap", **PROMPT_CONFIG)
    ceiling = with_decode_cap(
        plan_request(THRESHOLD_PROMPT, CEILING, BLOCK_SIZE, policy, NUM_LAYERS), THRESHOLD_CAP, None
    )
    totals = [int(counts.sum()) for counts in run.prompt_dump["counts"]]
    reported = with_kept_bound(ceiling, adaptive_kept_bound(ceiling, totals, NUM_KV_HEADS))
    assert reported.kept_bound < ceiling.kept_bound  # the threshold, not the ceiling, set the bound
    expected = [t for t in range(1, THRESHOLD_OUTPUT) if reported.rescores_at(t)]
    # The ceiling is above the cap (cut at the first token), the bound below it (the prompt grows first).
    assert ceiling.first_rescore == 1 < reported.first_rescore == expected[0], reported
    assert len(expected) >= 2
    assert run.dump["rescored_at"] == expected and run.rescores == len(expected)
    assert run.dump["kept_bound"] == reported.kept_bound
    assert run.freed == reported.blocks_freed(THRESHOLD_OUTPUT - 1) - reported.blocks_to_free > 0
    assert run.fallbacks == 0
    heads = NUM_LAYERS * NUM_KV_HEADS
    for index, (t, per_layer) in enumerate(zip(expected, run.dump["lengths_before"], strict=True)):
        if not index:  # the prompt's kept entries, then every token since
            assert sum(map(sum, per_layer)) == sum(totals) + heads * t, t
            continue
        since = t - expected[index - 1]
        assert sum(map(sum, per_layer)) == heads * (reported.kept_length(expected[index - 1]) + since), t
