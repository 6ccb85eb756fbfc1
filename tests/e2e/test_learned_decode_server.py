"""A decode-time cap with the learned scorer (``--kv-decode-eviction kvzap``) in a real ``vllm serve`` of the
bundled model, with its shipped scorer, through HTTP and the ``openai`` client, with the budget pooled across
layers (``budget_scope: "model"``: every layer's held entries ranked together at each re-score,
``datapath/pooled_decode.py``). The per-layer re-score runs through a real server in
``test_decode_eviction_server.py`` (other methods) and with this scorer through the worker's datapath
(``tests/unit/datapath/test_kvzap_decode_worker.py``).

One request: a 200-token prompt kept whole (``vllm_xargs kv_budget=1024``), so every eviction is
the decode cap's, generating 100 tokens capped at 64 entries per KV head on average over every layer and
head, re-scored every block (32 tokens). The worker saves each head's length right before every
re-score (``KVEVICT_DEBUG_DUMP_DIR``). Mechanics only: the answer's quality is not checked.
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
from vllm_kvevict.layout.accounting import RequestPlan, plan_request, with_decode_cap
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BLOCK_SIZE, CAP, NUM_LAYERS, NUM_KV_HEADS = 32, 64, 30, 3  # SmolLM2-135M
PROMPT_TOKENS, OUTPUT_TOKENS, WHOLE = 200, 100, 1024
SERVER_ARGS = (
    "--max-model-len", "1024", "--block-size", str(BLOCK_SIZE),
    "--kv-eviction", "kvzap", "--kv-budget", "64",
    "--kv-decode-eviction", "kvzap", "--kv-decode-budget", str(CAP),
    "--kv-eviction-config", json.dumps({"budget_scope": "model"}),
)  # fmt: skip
FREED = "vllm_kvevict_decode_blocks_freed_total"
RESCORES = "vllm_kvevict_decode_evictions_total"
FALLBACKS = "vllm_kvevict_policy_fallbacks_total"


def kvzap_total(server: VLLMServer, name: str) -> float:
    return sum(value for labels, value in server.metric_samples(name) if labels.get("method") == "kvzap")


def finished_dumps(dump_dir: Path, timeout_s: float = 60.0) -> list[Path]:
    """The decode dumps in ``dump_dir``, waiting for the first: the worker saves a request's record in the
    step that tells it the request finished, which may run after the answer reached the client."""
    deadline = time.monotonic() + timeout_s
    while not (dumps := list(dump_dir.glob("*.decode.pt"))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return dumps


@dataclass
class Capped:
    text: str
    completion_tokens: int
    rescores: float  # re-scores counted while it decoded (every layer of it each)
    freed: float  # blocks it gave back while decoding
    fallbacks: float
    dump: dict
    plan: RequestPlan
    log: str


@pytest.fixture(scope="module")
def capped(model_dir, tmp_path_factory) -> Capped:
    from transformers import AutoTokenizer

    dump_dir = tmp_path_factory.mktemp("learned-decode")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tokenizer("The lighthouse keeper wrote in his log every night. " * 40)["input_ids"][
        :PROMPT_TOKENS
    ]
    plan = with_decode_cap(
        plan_request(PROMPT_TOKENS, WHOLE, BLOCK_SIZE, build_policy("kvzap"), NUM_LAYERS), CAP, None
    )
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, env={DEBUG_DUMP_ENV: str(dump_dir)}) as server:
        result = client_of(server, timeout_s=900).completions.create(
            model=server.served_model_name, prompt=prompt, max_tokens=OUTPUT_TOKENS, temperature=0,
            extra_body=ignore_eos_body({"kv_budget": WHOLE}),
        )  # fmt: skip
        dumps = finished_dumps(dump_dir)
        assert len(dumps) == 1, dumps
        return Capped(
            text=result.choices[0].text,
            completion_tokens=result.usage.completion_tokens,
            rescores=kvzap_total(server, RESCORES),
            freed=kvzap_total(server, FREED),
            fallbacks=kvzap_total(server, FALLBACKS),
            dump=torch.load(dumps[0]),
            plan=plan,
            log=Path(server.log_path).read_text(),
        )


def test_the_capped_request_answers(capped: Capped) -> None:
    assert capped.completion_tokens == OUTPUT_TOKENS and capped.text.strip()


def test_the_learned_scorer_re_scores_on_the_plans_schedule_without_falling_back(capped: Capped) -> None:
    plan = capped.plan
    assert not plan.compacts  # kept whole: every eviction is the decode cap's
    expected = [t for t in range(1, OUTPUT_TOKENS) if plan.rescores_at(t)]
    assert len(expected) >= 3
    assert capped.dump["rescored_at"] == expected and capped.rescores == len(expected)
    assert capped.fallbacks == 0 and "failed on request" not in capped.log
    assert "kv-eviction: decode kvzap scores with " in capped.log


def test_blocks_are_freed_while_decoding_and_the_request_holds_the_ranked_total(capped: Capped) -> None:
    plan = capped.plan
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
