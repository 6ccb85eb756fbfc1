"""The HF reference of decode-time caps with the learned scorer (``--kv-decode-eviction kvzap``), per layer
and with every layer ranked together (``DecodeCap(pooled=True)``, the server's ``budget_scope: "model"``), on
a tiny random-weight Llama and a random-weight scorer of its shapes (mechanics, not quality).

One re-score (after 16 generated tokens): until then nothing is evicted, so the entries it judges are a plain
forward's cache, scored here by the scorer itself; the kept sets must be each head's best ``cap`` (per
layer) or the best ``L x H x cap`` of every layer and head (pooled), sinks and each head's newest window
first, and every later token is held after them."""

from __future__ import annotations

import pytest
import torch
from learned_scorers import random_scorer
from tiny_llama import tiny_llama
from transformers import DynamicCache, LlamaForCausalLM

from vllm_kvevict.hf_reference.decode_eviction import DecodeCap, capped_decode
from vllm_kvevict.policies.kept_masks import across_layers_mask, top_k_mask
from vllm_kvevict.policies.registry import build_decode_policy

PROMPT, STEPS, INTERVAL, CAP, SINKS, WINDOW = 24, 20, 16, 12, 2, 4
HEADS, DIM, LAYERS = 2, 16, 3


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    return tiny_llama(LAYERS, HEADS, DIM)


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("scorer")
    scorer = random_scorer(LAYERS, HEADS, DIM, kind="mlp", seed=5)
    scorer.save(directory)
    return scorer, str(directory)


@torch.inference_mode()
def judged_scores(model: LlamaForCausalLM, ids: torch.Tensor, scorer) -> torch.Tensor:
    """[L, H, n] the scorer's scores of a plain forward's cache over ``ids``, ``+inf`` at the sinks and each
    head's newest WINDOW."""
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[None], past_key_values=cache, use_cache=True)
    rows = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
    scores = torch.stack([scorer.layer_scores(i, k, v).float() for i, (k, v) in enumerate(rows)])
    positions = torch.arange(ids.shape[0])
    forced = (positions < SINKS) | (positions >= ids.shape[0] - WINDOW)
    return scores.masked_fill(forced, float("inf"))


def positions_of(keep: torch.Tensor) -> list[list[int]]:
    """keep [rows, n] bool -> the positions each row marks."""
    return [torch.nonzero(row).flatten().tolist() for row in keep]


def held_of(held: torch.Tensor) -> list[list[int]]:
    """held [rows, M] positions, -1 padded -> each row's positions."""
    return [[int(p) for p in row if p >= 0] for row in held]


def test_one_rescore_keeps_the_scorers_best_per_layer_or_ranked_across_layers(tiny_model, scorer) -> None:
    surrogate, directory = scorer
    policy = build_decode_policy("kvzap", scorer=directory, window=WINDOW, sinks=SINKS)
    ids = torch.randint(0, 256, (PROMPT + STEPS,), generator=torch.Generator().manual_seed(2))
    configs = [DecodeCap(policy, CAP), DecodeCap(policy, CAP, pooled=True), DecodeCap(None)]
    run = capped_decode(tiny_model, ids[:PROMPT], configs, STEPS, INTERVAL, forced=ids[PROMPT:])
    assert run.labels[1] == "kvzap pooled@12"
    judged = PROMPT + INTERVAL  # what the re-score judged: the prompt and 16 generated tokens
    scores = judged_scores(tiny_model, ids[:judged], surrogate)
    later = list(range(judged, PROMPT + STEPS - 1))  # written after the re-score, held whole
    per_layer = top_k_mask(scores.reshape(LAYERS * HEADS, judged), CAP)
    assert held_of(run.held[0]) == [kept + later for kept in positions_of(per_layer)]
    pooled = across_layers_mask(scores, LAYERS * HEADS * CAP).reshape(LAYERS * HEADS, judged)
    assert held_of(run.held[1]) == [kept + later for kept in positions_of(pooled)]
    counts = pooled.sum(dim=1)
    assert int(counts.sum()) == LAYERS * HEADS * CAP and int(counts.max()) > CAP > int(counts.min())
    for row in (0, 1):  # the cap changed what the later tokens saw
        assert not torch.allclose(run.nll[row, INTERVAL + 1 :], run.nll[2, INTERVAL + 1 :], atol=1e-4)


def test_only_a_method_that_scores_rows_alone_is_ranked_across_layers() -> None:
    from vllm_kvevict.policies.decode import DecodeH2O

    with pytest.raises(ValueError, match=r"pooled=True with \w+: ranking across layers needs"):
        DecodeCap(DecodeH2O(), 64, pooled=True)


def test_a_pooled_cap_above_what_any_head_holds_reads_as_the_full_cache(tiny_model, scorer) -> None:
    _, directory = scorer
    policy = build_decode_policy("kvzap", scorer=directory, window=WINDOW, sinks=SINKS)
    ids = torch.randint(0, 256, (PROMPT + STEPS,), generator=torch.Generator().manual_seed(3))
    configs = [DecodeCap(policy, PROMPT + STEPS, pooled=True), DecodeCap(None)]
    run = capped_decode(tiny_model, ids[:PROMPT], configs, STEPS, INTERVAL, forced=ids[PROMPT:])
    assert held_of(run.held[0]) == [list(range(PROMPT + STEPS - 1))] * (LAYERS * HEADS)
    torch.testing.assert_close(run.nll[0], run.nll[1], atol=1e-5, rtol=1e-6)
