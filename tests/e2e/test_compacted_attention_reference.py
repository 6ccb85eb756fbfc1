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

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from reference_checks import (
    assert_agrees_along_the_run,
    assert_vllm_sides_with_the_eviction,
    logprob_gap,
    near_tie_margin,
    tokens_and_logprobs,
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


def travel_prompt(tokenizer, num_tokens: int, seed: int = 11) -> list[int]:
    rng = random.Random(seed)
    names = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi"]
    cities = ["Paris", "Lima", "Oslo", "Cairo", "Quito", "Seoul", "Perth", "Rome"]
    lines = ["Travel log of the club."]
    tail = "\nNow write a long story about all these journeys, day by day.\n"
    while len(tokenizer("\n".join(lines) + tail)["input_ids"]) < num_tokens:
        lines.append(
            f"On day {len(lines)}, {rng.choice(names)} went from {rng.choice(cities)} to "
            f"{rng.choice(cities)} and paid {rng.randint(10, 99)} coins."
        )
    return tokenizer("\n".join(lines) + tail)["input_ids"]


def generate_in_vllm(
    server: VLLMServer, prompt_ids: list[int], neighbours: list[list[int]], new_tokens: int = NEW_TOKENS
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``new_tokens`` greedy tokens and their log-probabilities for ``prompt_ids``, while
    ``neighbours`` (other prompts) run in the same batches: a short one from the start, the others arriving
    mid-decode, so the checked request also decodes in steps where other requests prefill and compact."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="unused", timeout=1800, max_retries=0)

    def complete(ids: list[int], max_tokens: int, delay_s: float = 0.0):
        time.sleep(delay_s)
        return client.completions.create(
            model=server.served_model_name, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )

    with ThreadPoolExecutor(max_workers=1 + len(neighbours)) as pool:
        checked = pool.submit(complete, prompt_ids, new_tokens)
        others = [pool.submit(complete, ids, 48, 3.0 * i) for i, ids in enumerate(neighbours)]
        result = checked.result()
        assert all(o.result().usage.completion_tokens == 48 for o in others)
    return tokens_and_logprobs(result.choices[0].logprobs)


def kept_argument(evicting, kept: list) -> list:
    """``evicting`` takes one kept set per layer, or (batched form) a list of those per batch row."""
    import inspect

    batched = "kept_rows" in inspect.signature(evicting).parameters
    return [kept] if batched else kept


@torch.inference_mode()
def teacher_forced(model, prompt_ids: list[int], tokens: torch.Tensor, kept) -> torch.Tensor:
    """[T, vocab] float32 HF log-probabilities of each step along ``tokens`` with per-layer ``kept`` sets."""
    from vllm_kvevict.hf_reference.capture import prefill
    from vllm_kvevict.hf_reference.generation import cache_prefix, evicting

    prompt = prefill(model, torch.tensor(prompt_ids), capture=False)
    cache = cache_prefix(model, prompt)
    with evicting(model, kept_argument(evicting, kept), len(prompt_ids)):
        out = model(input_ids=tokens[None, :-1], past_key_values=cache, use_cache=True)
    # Step 0 comes from the prefill logits, before any eviction (as in vLLM).
    logits = torch.cat([prompt.last_logits[None], out.logits[0].float()])
    return torch.log_softmax(logits, dim=-1)


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
        tokens, vllm_logprobs = generate_in_vllm(server, prompt_ids, neighbours)
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
