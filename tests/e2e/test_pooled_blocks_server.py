"""A budget pooled across layers, served: ``vllm serve --kv-eviction kvzap --kv-budget 0.25
--kv-eviction-config '{"budget_scope": "model"}'`` ranks every layer's entries of a prompt together, and the
request's kept blocks hold every layer's sub-blocks (``docs/design_modes.md``, "Per-layer block budgets").

One request goes through the real server with ``KVEVICT_DEBUG_DUMP_DIR`` set, batched with neighbours that
prefill and compact while it decodes. Checked:
- the kept sets: the plan's exact total over all layers, layers keeping different shares, and a largest
  layer keeping more entries per head than the blocks the scheduler left could hold with per-layer pools
  (so the pooled sub-blocks are what make it fit);
- the attention: HF transformers (float32) keeps the same (layer, head, token) entries and is fed vLLM's
  generated tokens; every step's log-probability of vLLM's token agrees within bf16 tolerance, over 256
  steps that cross sub-block boundaries at different steps in different layers; a full-cache HF run is the
  control (vLLM must side with the masked run where the two differ).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference_checks import assert_agrees_along_the_run, assert_vllm_sides_with_the_eviction
from test_compacted_attention_reference import generate_in_vllm, teacher_forced, travel_prompt

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.layout.accounting import plan_request
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BUDGET, BLOCK_SIZE, LAYERS, HEADS = 0.25, 32, 30, 3  # SmolLM2-135M
PROMPT_TOKENS = 1100
SERVER_ARGS = (
    "--kv-eviction", "kvzap", "--kv-budget", str(BUDGET), "--block-size", str(BLOCK_SIZE),
    "--kv-eviction-config", json.dumps({"budget_scope": "model"}),
    "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
)  # fmt: skip


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory) -> dict:
    from vllm_kvevict.hf_reference.model import load_reference_model
    from vllm_kvevict.policies.base import KeptTokens

    dump_dir: Path = tmp_path_factory.mktemp("pooled")
    model, tokenizer = load_reference_model(model_dir, dtype=torch.float32)
    prompt_ids = travel_prompt(tokenizer, PROMPT_TOKENS)
    neighbours = [travel_prompt(tokenizer, 60, seed=1), travel_prompt(tokenizer, 700, seed=2)]
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, env={DEBUG_DUMP_ENV: str(dump_dir)}) as server:
        tokens, vllm_logprobs = generate_in_vllm(server, prompt_ids, neighbours, new_tokens=256)
    records = [torch.load(path) for path in dump_dir.glob("*.pt")]
    (record,) = [r for r in records if r["prompt_len"] == len(prompt_ids)]
    kept = [KeptTokens(i, c) for i, c in zip(record["indices"], record["counts"], strict=True)]
    everything = [KeptTokens.everything(HEADS, len(prompt_ids)) for _ in kept]
    return {
        "prompt_ids": prompt_ids,
        "tokens": tokens,
        "vllm_logprobs": vllm_logprobs,
        "counts": torch.stack([k.counts for k in kept]),  # [L, H]
        "masked": teacher_forced(model, prompt_ids, tokens, kept),
        "full": teacher_forced(model, prompt_ids, tokens, everything),
    }


def test_the_kept_total_is_the_plans_and_layers_share_it_unevenly(run: dict) -> None:
    prompt_len = len(run["prompt_ids"])
    plan = plan_request(prompt_len, BUDGET, BLOCK_SIZE, build_policy("kvzap"), LAYERS)
    counts = run["counts"]
    assert int(counts.sum()) == HEADS * sum(plan.layer_budgets)
    per_layer = counts.float().mean(dim=1)
    assert float(per_layer.max()) > 1.5 * float(per_layer.min())
    # The largest layer keeps more per head than the request's kept blocks hold in one layer's region: only
    # sub-blocks of other layers' regions make it fit.
    kept_blocks = -(-prompt_len // BLOCK_SIZE) - plan.blocks_to_free
    assert float(per_layer.max()) > kept_blocks * BLOCK_SIZE, (per_layer.tolist(), kept_blocks)


def test_decoding_matches_hf_keeping_the_same_entries(run: dict) -> None:
    assert len(run["tokens"]) == 256
    assert_agrees_along_the_run(run["vllm_logprobs"], run["tokens"], run["masked"])


def test_vllm_follows_the_masked_reference_where_eviction_changes_the_output(run: dict) -> None:
    assert_vllm_sides_with_the_eviction(
        run["vllm_logprobs"], run["tokens"], run["masked"], run["full"], min_moved=10
    )
