"""The HF reference of per-chunk eviction (``hf_reference.chunked_prefill``) with the learned scorer, on a
tiny random-weight Llama and a random-weight scorer of its shapes (mechanics, not quality): chunk by chunk
keeps what one eviction of the whole prompt keeps.

Per chunk, a later chunk's keys and values above layer 0 are computed attending only to what the heads held,
so they differ from the whole prompt's; the invariance is then the selection's: the per-chunk kept set is
what the method keeps of the cache the chunks computed, judged once whole. At layer 0 the entries are the
same in both runs, and so is the kept set."""

from __future__ import annotations

import pytest
import torch
from learned_scorers import random_scorer
from tiny_llama import tiny_llama
from transformers import LlamaForCausalLM

from vllm_kvevict.hf_reference.chunked import chunked_prefill
from vllm_kvevict.layout.accounting import request_planner
from vllm_kvevict.policies.base import LayerKV
from vllm_kvevict.policies.registry import build_policy

N, CHUNK, BUDGET, BLOCK = 320, 64, 48, 16
HEADS, DIM, LAYERS = 2, 16, 2


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    return tiny_llama(LAYERS, HEADS, DIM)


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("scorer")
    random_scorer(LAYERS, HEADS, DIM, kind="mlp", seed=3).save(directory)
    return str(directory)


def kept_positions(kept) -> list[list[int]]:
    return [kept.head(h).tolist() for h in range(kept.counts.shape[0])]


@pytest.mark.parametrize(("method", "chunk_budget"), [("kvzap", BUDGET), ("ada-kvzap", HEADS * BUDGET)])
def test_chunk_by_chunk_keeps_what_the_whole_prompt_keeps(tiny_model, scorer_dir, method, chunk_budget):
    policy = build_policy(method, scorer=scorer_dir, window=8, sinks=2)
    ids = torch.randint(0, 256, (N,), generator=torch.Generator().manual_seed(1))
    plan_for = request_planner(BUDGET, BLOCK, policy, LAYERS, chunk_budget=chunk_budget)
    plan = plan_for(N)
    chunked = chunked_prefill(tiny_model, ids, policy, plan, CHUNK)
    assert len(chunked.chunks) >= 2  # it evicted between chunks
    whole = chunked_prefill(tiny_model, ids, policy, request_planner(BUDGET, BLOCK, policy, LAYERS)(N), N)
    assert kept_positions(chunked.kept[0]) == kept_positions(whole.kept[0])
    for layer_idx in range(LAYERS):
        cache = LayerKV(
            keys=chunked.prompt.keys[layer_idx][0],
            values=chunked.prompt.values[layer_idx][0],
            queries=torch.empty(4, 0, DIM),
            layer_idx=layer_idx,
            num_layers=LAYERS,
        )
        judged_whole = policy.select(cache, plan.layer_budgets[layer_idx])
        assert kept_positions(chunked.kept[layer_idx]) == kept_positions(judged_whole)


def test_the_threshold_mode_keeps_an_adaptive_count_through_the_hf_runner(tiny_model, scorer_dir):
    """kvzap with ``threshold``: each head of each layer keeps its entries scoring above it (sinks and the
    window too), so the counts differ per head and layer, and the HF runner generates over those sets. The
    budget is the mode's ceiling: the whole prompt here (as the grid's threshold rows run), so the threshold
    alone decides."""
    from vllm_kvevict.hf_reference.capture import capture_layers
    from vllm_kvevict.hf_reference.eviction import kept_per_layer
    from vllm_kvevict.hf_reference.generation import generate_with_kept

    ids = torch.randint(0, 256, (N,), generator=torch.Generator().manual_seed(2))
    layers = capture_layers(tiny_model, ids, query_window=1)
    plain = build_policy("kvzap", scorer=scorer_dir, window=8, sinks=2)
    scores = torch.cat([plain.entry_scores(layer).flatten() for layer in layers])
    tau = float(scores.quantile(0.7))  # about 30 % kept, set by the scores, not by a budget
    policy = build_policy("kvzap", scorer=scorer_dir, window=8, sinks=2, threshold=tau)
    kept = kept_per_layer(policy, layers, N)
    counts = [c for k in kept for c in k.counts.tolist()]
    assert len(set(counts)) > 1 and all(10 <= c < N for c in counts)
    for layer, chosen in zip(layers, kept, strict=True):
        expected = plain.score(layer, BUDGET) > tau
        assert torch.equal(chosen.to_mask(N), expected)
    tokens, logits = generate_with_kept(tiny_model, ids, kept, 4)
    assert tokens.shape == (4,) and torch.isfinite(logits).all()
