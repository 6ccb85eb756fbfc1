"""The compacted attention inside vLLM equals attention that keeps the same per-head entries in HF.

One request goes through a real ``vllm serve --kv-eviction ada-snapkv`` (ragged per-head budgets), batched
with neighbours that prefill and compact while it decodes, with ``KVEVICT_DEBUG_DUMP_DIR`` set, so the worker
saves the kept token indices of every layer and KV head. HF transformers (float32,
``vllm_kvevict.hf_reference``) then runs the same prompt with full attention, hides every evicted (layer,
head, token) entry, and is fed vLLM's 512 generated tokens (teacher forcing). Each step's log-probability of
vLLM's token must match within bf16 tolerance: the first steps check the compacted read, all 512 steps check
that no head's cache is corrupted when heads cross sub-block boundaries at different steps, in mixed batches.
A full-cache HF run is the control: vLLM must side with the masked run where the two differ.
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
BLOCK_SIZE = 128
PROMPT_TOKENS = 1100
NEW_TOKENS = 512
FIRST_STEPS = 16
#: The prompt's own window judges it (``question_echo: 0``): this checks the attention over what was kept,
#: and its near-tie bounds were set on that kept set; the echo's kept sets and their decoding against HF
#: are ``test_question_echo_server.py``'s.
SERVER_ARGS = (
    "--kv-eviction", "ada-snapkv", "--kv-budget", str(BUDGET),
    "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
    "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
    "--kv-eviction-config", '{"question_echo": 0}',
)


@dataclass(frozen=True)
class Run:
    """What vLLM produced and what HF computes along vLLM's tokens.

    prompt_ids [P]; tokens [T] vLLM's greedy tokens; vllm_logprobs [T] their log-probabilities in vLLM;
    kept: per layer (indices [H, max], counts [H]); masked / full: [T, vocab] HF log-probabilities with the
    evicted entries hidden / with the full cache.
    """

    prompt_ids: list[int]
    tokens: torch.Tensor
    vllm_logprobs: torch.Tensor
    kept: list[tuple[torch.Tensor, torch.Tensor]]
    masked: torch.Tensor
    full: torch.Tensor

    def gap(self, logprobs: torch.Tensor) -> torch.Tensor:
        """[T] |log p_vllm(token) - log p_ref(token)| per step."""
        return logprob_gap(self.vllm_logprobs, self.tokens, logprobs)


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory) -> Run:
    from vllm_kvevict.hf_reference.model import load_reference_model
    from vllm_kvevict.policies.base import KeptTokens

    dump_dir: Path = tmp_path_factory.mktemp("kept")
    model, tokenizer = load_reference_model(model_dir, dtype=torch.float32)
    prompt_ids = travel_prompt(tokenizer, PROMPT_TOKENS)
    # A short request that never compacts, and two that prefill and compact while the checked one decodes.
    neighbours = [travel_prompt(tokenizer, 60, seed=1), travel_prompt(tokenizer, 700, seed=2),
                  travel_prompt(tokenizer, 900, seed=3)]
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, env={DEBUG_DUMP_ENV: str(dump_dir)}) as server:
        tokens, vllm_logprobs = generate_in_vllm(server, prompt_ids, neighbours, NEW_TOKENS)
    records = [torch.load(path) for path in dump_dir.glob("*.pt")]
    assert sorted(r["prompt_len"] for r in records) == sorted(len(p) for p in (prompt_ids, *neighbours[1:]))
    (record,) = [r for r in records if r["prompt_len"] == len(prompt_ids)]
    kept = [KeptTokens(i, c) for i, c in zip(record["indices"], record["counts"], strict=True)]
    everything = [KeptTokens.everything(k.counts.shape[0], len(prompt_ids)) for k in kept]
    return Run(
        prompt_ids=prompt_ids,
        tokens=tokens,
        vllm_logprobs=vllm_logprobs,
        kept=[(k.indices, k.counts) for k in kept],
        masked=teacher_forced(model, prompt_ids, tokens, kept),
        full=teacher_forced(model, prompt_ids, tokens, everything),
    )


def test_kept_sets_are_ragged_per_head_and_cross_sub_blocks_at_different_steps(run: Run):
    assert len(run.tokens) == NEW_TOKENS
    for _indices, counts in run.kept:
        assert int(counts.max()) < len(run.prompt_ids), "a layer kept its whole prompt: nothing was evicted"
        assert counts.sum() % counts.numel() == 0  # layer total = H x layer budget
    # Ada-KV: heads keep different counts, so their sub-blocks fill up at different decode steps.
    assert any(len({int(c) % BLOCK_SIZE for c in counts}) > 1 for _, counts in run.kept)


def test_first_decode_steps_match_hf_keeping_the_same_entries(run: Run):
    gap = run.gap(run.masked)[:FIRST_STEPS]
    assert float(gap.max()) < 0.15, f"per-step |delta logprob| {gap.tolist()}"
    # vLLM's greedy token is HF's best, or within a near-tie of it (bf16 vs float32).
    assert float(near_tie_margin(run.tokens, run.masked)[:FIRST_STEPS].max()) < 0.1


def test_512_tokens_after_compaction_match_hf_keeping_the_same_entries(run: Run):
    assert_agrees_along_the_run(run.vllm_logprobs, run.tokens, run.masked)


def test_vllm_follows_the_masked_reference_where_eviction_changes_the_output(run: Run):
    """The control: where hiding the evicted entries moves HF's log-probability of vLLM's token by more than
    0.1, vLLM sides with the masked run, not the full-cache one (so the checks above can fail)."""
    assert_vllm_sides_with_the_eviction(run.vllm_logprobs, run.tokens, run.masked, run.full, min_moved=10)
    assert float(run.gap(run.masked).mean()) < 0.5 * float(run.gap(run.full).mean())
