"""Eviction on a real Qwen2 model: Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 query heads on 2 KV heads:
GQA groups of 7, head size 64, QKV bias) served by a real ``vllm serve --kv-eviction ada-snapkv``.

One server, vLLM's defaults for prefix caching and chunked prefill (a 512-token step budget, so the checked
prompt is prefilled in three chunks). The worker dumps the kept token indices of every layer and KV head
(``KVEVICT_DEBUG_DUMP_DIR``); HF transformers (float32, ``vllm_kvevict.hf_reference``) runs the same prompt
hiding every evicted (layer, head, token) entry and is fed vLLM's tokens (teacher forcing):
- the compacted attention equals HF's over the kept entries, and vLLM sides with that masked run where it
  differs from the full cache (the control that lets the check fail);
- a request whose own ``kv_budget`` covers its prompt is served as the full cache: it agrees with HF's
  full-cache run along its tokens, and its prompt is not compacted;
- eviction gives blocks back (``vllm_kvevict_blocks_freed_total``), a prompt sharing the checked one's prefix
  reads vLLM's prefix cache, and the KV pool is empty once every request is done;
- every registered method, chosen per request (``vllm_xargs.kv_eviction``), compacts a prompt on this model,
  or is refused with an HTTP 400 naming it: only a learned scorer may be, where none ships for the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from reference_checks import (
    assert_agrees_along_the_run,
    assert_vllm_sides_with_the_eviction,
    generate_in_vllm,
    logprob_gap,
    near_tie_margin,
    teacher_forced,
    travel_prompt,
)

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BUDGET = 64
BLOCK_SIZE = 32
PROMPT_TOKENS = 1100
NEW_TOKENS = 96
FIRST_STEPS = 16
KV_HEADS = 2
SERVER_ARGS = (
    "--kv-eviction", "ada-snapkv", "--kv-budget", str(BUDGET), "--block-size", str(BLOCK_SIZE),
    "--max-model-len", "2048", "--max-num-batched-tokens", "512", "--max-num-seqs", "4",
    "--kv-eviction-config", '{"question_echo": 0}',
)


@dataclass(frozen=True)
class Served:
    """What the server produced, with HF's log-probabilities along its tokens.

    evicted / kept_whole: (tokens [T], vLLM log-probabilities [T]) of the request at the server's budget and
    of the one whose ``kv_budget`` covers its prompt; kept: per layer (indices [H, max], counts [H]);
    masked / full / whole_full: [T, vocab] HF log-probabilities (evicted entries hidden; full cache along
    the evicted request's tokens; full cache along the kept-whole request's tokens).
    """

    prompt_ids: list[int]
    whole_prompt_len: int
    evicted: tuple[torch.Tensor, torch.Tensor]
    kept_whole: tuple[torch.Tensor, torch.Tensor]
    kept: list[tuple[torch.Tensor, torch.Tensor]]
    dumped_prompt_lens: list[int]
    masked: torch.Tensor
    full: torch.Tensor
    whole_full: torch.Tensor
    blocks_freed: float
    prefix_hits: float
    usage_after: float


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kept")


@pytest.fixture(scope="module")
def server(qwen_model_dir: Path, dump_dir: Path):
    with VLLMServer(qwen_model_dir, extra_args=SERVER_ARGS, env={DEBUG_DUMP_ENV: str(dump_dir)}) as running:
        yield running


@pytest.fixture(scope="module")
def reference():
    """(HF float32 model, tokenizer) of the served 0.5B."""
    from vllm_kvevict.cli.prepare_model import prepared_model_dir
    from vllm_kvevict.hf_reference.model import load_reference_model

    return load_reference_model(prepared_model_dir(model="qwen2.5-coder-0.5b"), dtype=torch.float32)


@pytest.fixture(scope="module")
def served(server: VLLMServer, reference, dump_dir: Path) -> Served:
    from vllm_kvevict.policies.base import KeptTokens

    model, tokenizer = reference
    prompt_ids = travel_prompt(tokenizer, PROMPT_TOKENS)
    neighbours = [travel_prompt(tokenizer, 60, seed=1), travel_prompt(tokenizer, 700, seed=2)]
    whole_prompt = travel_prompt(tokenizer, 800, seed=5)
    evicted = generate_in_vllm(server, prompt_ids, neighbours, NEW_TOKENS)
    kept_whole = generate_in_vllm(server, whole_prompt, [], NEW_TOKENS, vllm_xargs={"kv_budget": 4096})
    hits_before = server.metric_value("vllm:prefix_cache_hits_total")
    generate_in_vllm(server, prompt_ids[:900] + whole_prompt[:50], [], 8)
    prefix_hits = server.metric_value("vllm:prefix_cache_hits_total") - hits_before
    blocks_freed = sum(value for _, value in server.metric_samples("vllm_kvevict_blocks_freed_total"))
    usage_after = server.wait_for_metric("vllm:kv_cache_usage_perc", 0.0)
    records = [torch.load(path) for path in dump_dir.glob("*.pt")]
    (record,) = [r for r in records if r["prompt_len"] == len(prompt_ids)]
    kept = [KeptTokens(i, c) for i, c in zip(record["indices"], record["counts"], strict=True)]
    everything = [KeptTokens.everything(k.counts.shape[0], len(prompt_ids)) for k in kept]
    whole_everything = [KeptTokens.everything(k.counts.shape[0], len(whole_prompt)) for k in kept]
    return Served(
        prompt_ids=prompt_ids,
        whole_prompt_len=len(whole_prompt),
        evicted=evicted,
        kept_whole=kept_whole,
        kept=[(k.indices, k.counts) for k in kept],
        dumped_prompt_lens=sorted(r["prompt_len"] for r in records),
        masked=teacher_forced(model, prompt_ids, evicted[0], kept),
        full=teacher_forced(model, prompt_ids, evicted[0], everything),
        whole_full=teacher_forced(model, whole_prompt, kept_whole[0], whole_everything),
        blocks_freed=blocks_freed,
        prefix_hits=prefix_hits,
        usage_after=usage_after,
    )


def test_each_of_the_two_kv_heads_keeps_its_own_ragged_set(served: Served):
    assert len(served.kept) == 24
    for _indices, counts in served.kept:
        assert counts.shape == (KV_HEADS,)
        assert int(counts.max()) < len(served.prompt_ids), "a layer kept its whole prompt"
        # Ada-KV: the layer's total is H x B', the budget rounded up so P - B' is whole blocks (accounting).
        rounded, rest = divmod(int(counts.sum()), KV_HEADS)
        assert rest == 0 and BUDGET <= rounded < BUDGET + BLOCK_SIZE
        assert (len(served.prompt_ids) - rounded) % BLOCK_SIZE == 0
    assert any(int(c[0]) != int(c[1]) for _, c in served.kept), "Ada-KV gave all heads equal counts"
    assert any(not torch.equal(i[0, :8], i[1, :8]) for i, _ in served.kept), "both heads kept the same tokens"


def test_compacted_attention_matches_hf_keeping_the_same_entries(served: Served):
    tokens, logprobs = served.evicted
    gap = logprob_gap(logprobs, tokens, served.masked)[:FIRST_STEPS]
    assert float(gap.max()) < 0.15, f"per-step |delta logprob| {gap.tolist()}"
    assert float(near_tie_margin(tokens, served.masked)[:FIRST_STEPS].max()) < 0.1
    assert_agrees_along_the_run(logprobs, tokens, served.masked)


def test_vllm_follows_the_masked_reference_where_eviction_changes_the_output(served: Served):
    tokens, logprobs = served.evicted
    assert_vllm_sides_with_the_eviction(logprobs, tokens, served.masked, served.full, min_moved=5)


def test_a_budget_covering_the_prompt_serves_the_full_cache(served: Served):
    tokens, logprobs = served.kept_whole
    assert_agrees_along_the_run(logprobs, tokens, served.whole_full)
    # Only prompts over their budget were compacted (and dumped): not the kept-whole one.
    assert served.whole_prompt_len not in served.dumped_prompt_lens
    assert len(served.prompt_ids) in served.dumped_prompt_lens


def test_blocks_are_freed_the_prefix_cache_is_read_and_nothing_leaks(served: Served):
    assert served.blocks_freed > 0
    assert served.prefix_hits > 0
    assert served.usage_after == 0.0


def compacted_so_far(server: VLLMServer) -> float:
    return sum(value for _, value in server.metric_samples("vllm_kvevict_requests_compacted_total"))


def compacted_after(server: VLLMServer, expected: float, timeout_s: float = 10.0) -> float:
    """The compacted-requests counter once it reaches ``expected`` (or after ``timeout_s``)."""
    import time

    deadline = time.monotonic() + timeout_s
    while (found := compacted_so_far(server)) < expected and time.monotonic() < deadline:
        time.sleep(0.25)
    return found


def test_every_method_compacts_on_qwen2_or_is_refused_by_name(server: VLLMServer, reference):
    """Each registered method per request on a 700-token prompt at 64 tokens per head: compacted (the
    counter moves by one) or an HTTP 400 naming the method; a refusal only for a learned scorer. Each
    request has its own ``cache_salt``: a prefix-cache hit would leave its own part within budget."""
    import httpx

    from vllm_kvevict.policies.registry import method_names, method_needs_o_proj
    from vllm_kvevict.policies.surrogate_scorer import find_packaged_scorer, model_fingerprint

    _, tokenizer = reference
    prompt = travel_prompt(tokenizer, 700, seed=9)
    outcome: dict[str, str] = {}
    for method in method_names():
        before = compacted_so_far(server)
        response = httpx.post(f"{server.base_url}/completions", timeout=600, json={
            "model": server.served_model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "cache_salt": method, "vllm_xargs": {"kv_eviction": method, "kv_budget": 64}})
        if response.status_code == 400:
            assert method in response.text, response.text
            outcome[method] = "refused"
        else:
            assert response.status_code == 200, (method, response.text)
            assert compacted_after(server, before + 1) == before + 1, f"{method} did not compact"
            outcome[method] = "compacted"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(server.model_dir))
    ships = find_packaged_scorer(model_fingerprint(config)) is not None
    # A CriticalKV method per request needs the o_proj weights a server collects only when its own method
    # reads them; a learned one needs a scorer fitted on this model.
    may_refuse = {m for m in outcome if method_needs_o_proj(m)} | (set() if ships else {"kvzap", "ada-kvzap"})
    refused = {m for m, o in outcome.items() if o == "refused"}
    assert refused <= may_refuse, outcome
    assert server.wait_for_metric("vllm:kv_cache_usage_perc", 0.0) == 0.0
