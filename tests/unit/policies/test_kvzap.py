"""kvzap and ada-kvzap: the learned scorer's scores, sinks and window kept, exact budgets, Ada-KV's
allocation, the threshold mode, the scorer directory parameter, and the same kept set chunk by chunk as
whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from learned_scorers import random_scorer, scorer_shaped_like
from policy_layers import random_layer

from vllm_kvevict.policies import served_scorer
from vllm_kvevict.policies.adakv import AdaKV
from vllm_kvevict.policies.base import LayerKV
from vllm_kvevict.policies.between_chunks import between_chunks
from vllm_kvevict.policies.kept_masks import safeguard_size
from vllm_kvevict.policies.kvzap import KVzap, learned_part
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.policies.surrogate_scorer import scores_each_head_alone

N, BUDGET = 120, 48


def scorer_scores(layer: LayerKV) -> torch.Tensor:
    """[H, n] what the layer's scorer predicts, computed here from the scorer itself."""
    return scorer_shaped_like(layer).layer_scores(layer.layer_idx, layer.keys, layer.values)


def test_scores_are_the_scorers_with_sinks_and_window_forced() -> None:
    policy = build_policy("kvzap", window=8, sinks=2)
    layer = random_layer(n=N, w=1, layer_idx=2)
    scores = policy.score(layer, BUDGET)
    forced = torch.cat([torch.arange(2), torch.arange(N - 8, N)])
    assert torch.isinf(scores[:, forced]).all()
    rest = torch.ones(N, dtype=torch.bool)
    rest[forced] = False
    torch.testing.assert_close(scores[:, rest], scorer_scores(layer)[:, rest])


@pytest.mark.parametrize("layer_idx", [0, 3])
def test_each_head_keeps_exactly_the_budget_its_best_scores_sinks_and_window(layer_idx: int) -> None:
    policy = build_policy("kvzap", window=8, sinks=2)
    layer = random_layer(kv_heads=3, n=N, w=1, layer_idx=layer_idx)
    kept = policy.select(layer, BUDGET)
    assert kept.counts.tolist() == [BUDGET] * 3
    raw = scorer_scores(layer)
    for h in range(3):
        head = set(kept.head(h).tolist())
        assert {0, 1, *range(N - 8, N)} <= head
        chosen = sorted(set(range(2, N - 8)), key=lambda i: -float(raw[h, i]))[: BUDGET - 10]
        assert head == {0, 1, *range(N - 8, N), *chosen}


def test_ada_kvzap_allocates_the_layers_budget_across_heads_by_the_same_scores() -> None:
    policy = build_policy("ada-kvzap", window=8, sinks=2, alpha=0.25)
    assert isinstance(policy, AdaKV) and learned_part(policy) == KVzap(window=8, sinks=2)
    layer = random_layer(kv_heads=4, n=N, w=1, seed=3)
    kept = policy.select(layer, BUDGET)
    assert kept.total == 4 * BUDGET
    assert len(set(kept.counts.tolist())) > 1  # ragged: the scores, not the budget, split the slots
    scores = KVzap(window=8, sinks=2).score(layer, BUDGET)
    mask = kept.to_mask(N)
    guard = torch.zeros_like(mask)
    for h in range(4):  # the safeguard: every head keeps its own best alpha * budget
        guard[h, scores[h].topk(safeguard_size(BUDGET, 0.25)).indices] = True
    assert mask[guard].all()
    # the shared stage: nothing left out scores above anything taken beyond the safeguards
    assert float(scores[~mask].max()) <= float(scores[mask & ~guard].min())


def test_the_threshold_mode_keeps_every_entry_scoring_above_it_so_counts_adapt_per_head() -> None:
    layer = random_layer(kv_heads=3, n=N, w=1, seed=5)
    raw = scorer_scores(layer)
    tau = float(raw.median())
    kept = build_policy("kvzap", window=8, sinks=2, threshold=tau).select(layer, N)  # a ceiling of n
    expected = raw > tau
    expected[:, :2] = True
    expected[:, N - 8 :] = True
    assert torch.equal(kept.to_mask(N), expected)
    assert len(set(kept.counts.tolist())) > 1 and kept.total < 3 * N  # the scores set the counts


def test_the_budget_is_the_threshold_modes_ceiling_over_the_layer() -> None:
    layer = random_layer(kv_heads=3, n=N, w=1, seed=5)
    policy = build_policy("kvzap", window=8, sinks=2, threshold=float(scorer_scores(layer).median()))
    above = policy.select(layer, N).to_mask(N)
    ceiling = above.sum() // 2 // 3
    kept = policy.select(layer, int(ceiling))
    assert kept.total == 3 * ceiling and len(set(kept.counts.tolist())) > 1  # ragged under the ceiling
    mask = kept.to_mask(N)
    scores = policy.score(layer, int(ceiling))
    assert bool((mask <= above).all())  # nothing below the threshold
    assert float(scores[above & ~mask].max()) <= float(scores[mask].min())  # the layer's best of the rest
    assert policy.adapts_kept_count and not build_policy("kvzap").adapts_kept_count


def test_ada_kvzap_refuses_the_threshold_mode_naming_kvzap() -> None:
    with pytest.raises(ValueError, match="threshold=0.5 keeps a count set by the scores.*use kvzap"):
        build_policy("ada-kvzap", threshold=0.5)


def test_a_scorer_directory_parameter_scores_with_that_scorer(tmp_path) -> None:
    layer = random_layer(n=N, w=1, layer_idx=1)
    saved = random_scorer(layer.num_layers, layer.num_kv_heads, layer.keys.shape[2], kind="mlp", seed=7)
    saved.save(tmp_path)
    policy = build_policy("kvzap", scorer=str(tmp_path), window=0, sinks=0)
    expected = saved.layer_scores(1, layer.keys, layer.values)
    torch.testing.assert_close(policy.score(layer, BUDGET), expected)
    assert not torch.allclose(expected, scorer_scores(layer))  # not the directory-less default


def test_a_directory_that_is_no_scorer_is_refused_naming_calibrate(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not a scorer directory.*vllm-kvevict calibrate"):
        build_policy("kvzap", scorer=str(tmp_path))


def test_a_scorer_of_other_shapes_is_refused_naming_both_and_calibrate(tmp_path) -> None:
    random_scorer(4, 2, 8).save(tmp_path)  # the layer below has head_dim 16
    with pytest.raises(ValueError, match="2 KV heads of 8; this layer .* 2 KV heads of 16.*calibrate"):
        build_policy("kvzap", scorer=str(tmp_path)).select(random_layer(n=N, w=1), BUDGET)


def test_without_a_served_scorer_a_policy_without_directory_names_calibrate(monkeypatch) -> None:
    monkeypatch.undo()  # the unit tests' random scorer off: this process serves nothing
    with pytest.raises(ValueError, match="no served model; fit one with `vllm-kvevict calibrate"):
        build_policy("kvzap").select(random_layer(n=N, w=1), BUDGET)


def test_kvzap_reads_values_and_no_queries() -> None:
    layer = random_layer(n=N, w=1)
    with pytest.raises(ValueError, match="reads the layer's values"):
        build_policy("kvzap").select(dataclasses.replace(layer, values=None), BUDGET)
    other_queries = dataclasses.replace(layer, queries=layer.queries * -3.0)
    assert torch.equal(
        build_policy("kvzap").select(layer, BUDGET).to_mask(N),
        build_policy("kvzap").select(other_queries, BUDGET).to_mask(N),
    )


def held_after_chunks(policy, layer: LayerKV, chunk: int, between_budget: int, budget: int) -> torch.Tensor:
    """[H, n] the final kept mask of ``policy`` on ``layer`` evicted chunk by chunk as the datapath does:
    after each chunk every head keeps ``between_budget`` of its held entries plus the chunk (the
    between-chunks selection, scored on the held entries in position order), then ``budget`` at the end."""
    n, heads = layer.num_tokens, layer.num_kv_heads
    held = torch.empty(heads, 0, dtype=torch.int64)  # [H, a] positions held after the last chunk
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        positions = torch.cat([held, torch.arange(start, end).expand(heads, -1)], dim=1)
        index = positions[..., None].expand(-1, -1, layer.keys.shape[2])
        view = dataclasses.replace(
            layer, keys=layer.keys.gather(1, index), values=layer.values.gather(1, index)
        )
        final = end == n
        selector = policy if final else between_chunks(policy, "blend", between_budget)
        kept = selector.select(view, min(budget if final else between_budget, positions.shape[1]))
        if final:
            mask = torch.zeros(heads, n, dtype=torch.bool)
            for h in range(heads):
                mask[h, positions[h, kept.head(h)]] = True
            return mask
        held = positions.gather(1, kept.indices)  # every head keeps the same count between chunks
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("method", "between_budget"), [("kvzap", BUDGET), ("kvzap", 70), ("ada-kvzap", 4 * BUDGET)]
)
def test_chunk_by_chunk_keeps_the_whole_prompts_set_when_the_intermediate_budget_allows(
    method: str, between_budget: int
) -> None:
    """kvzap: any intermediate budget >= the final one; ada-kvzap (uniform between chunks, ragged at the end):
    one >= the largest head budget, here H x B."""
    policy = build_policy(method, window=8, sinks=2)
    n = 400
    layer = random_layer(kv_heads=4, n=n, w=1, seed=9, layer_idx=1)
    whole = policy.select(layer, BUDGET).to_mask(n)
    assert torch.equal(held_after_chunks(policy, layer, 64, between_budget, BUDGET), whole)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_scorer_reading_every_heads_row_is_told_apart_and_loses_the_whole_prompts_set(
    kind: str, tmp_path
) -> None:
    """Between chunks each head holds its own tokens, so one cache row mixes tokens across heads: a scorer
    that reads every head's features then scores an entry by other tokens (why it is refused per chunk)."""
    assert scores_each_head_alone(random_scorer(4, 4, 16, kind))
    mixed = random_scorer(4, 4, 16, kind, per_head=False)
    assert not scores_each_head_alone(mixed)
    mixed.save(tmp_path)
    policy = build_policy("kvzap", scorer=str(tmp_path), window=8, sinks=2)
    layer = random_layer(kv_heads=4, n=400, w=1, seed=9, layer_idx=1)
    whole = policy.select(layer, BUDGET).to_mask(400)
    assert not torch.equal(held_after_chunks(policy, layer, 64, BUDGET, BUDGET), whole)


def test_a_query_scored_method_does_not_keep_the_whole_prompts_set_chunk_by_chunk() -> None:
    """The check above can fail: SnapKV judges by the last window, which differs chunk by chunk."""
    policy = build_policy("snapkv", window=8)
    n = 400
    layer = random_layer(kv_heads=4, n=n, w=n, seed=9)
    whole = policy.select(layer, BUDGET).to_mask(n)
    windowed = dataclasses.replace(layer, queries=layer.queries[:, -8:])
    assert not torch.equal(held_after_chunks(policy, windowed, 64, BUDGET, BUDGET), whole)


def test_between_chunks_a_learned_method_judges_by_its_own_scores_under_the_default_rule() -> None:
    assert between_chunks(build_policy("ada-kvzap"), "blend") == build_policy("kvzap")
    assert between_chunks(build_policy("kvzap"), "window") == build_policy("kvzap")
    assert type(between_chunks(build_policy("kvzap"), "keydiff")).__name__ == "KeyDiff"  # asked for: kept


def test_serve_model_finds_no_scorer_for_an_unknown_model_and_names_calibrate() -> None:
    config = type(
        "Config",
        (),
        {
            "architectures": ["NoSuchForCausalLM"],
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "hidden_size": 8,
            "vocab_size": 3,
        },
    )()
    try:
        problem = served_scorer.serve_model(config, "no-such-model")
        assert problem is not None and problem.startswith("no learned scorer ships for no-such-model")
        assert "vllm-kvevict calibrate MODEL --out DIR" in problem
        assert served_scorer.served_scorer_problem() == problem
    finally:
        served_scorer.forget_served_model()
    assert served_scorer.served_scorer_problem() is None


def test_a_layer_scoped_threshold_compares_scores_standardised_by_the_layers_level(tmp_path) -> None:
    from vllm_kvevict.policies.surrogate_scorer import SurrogateScorer

    layer = random_layer(kv_heads=3, n=N, w=1, seed=5, layer_idx=1)
    base = scorer_shaped_like(layer)
    layers = layer.num_layers
    levels = {"mean": [0.3 * i for i in range(layers)], "std": [1.0 + 0.5 * i for i in range(layers)]}
    SurrogateScorer(dataclasses.replace(base.spec, score_levels=levels), base.layers).save(tmp_path)
    policy = build_policy(
        "kvzap", scorer=str(tmp_path), window=8, sinks=2, threshold=0.5, threshold_scope="layer"
    )
    kept = policy.select(layer, N)
    raw = scorer_scores(layer)
    expected = (raw - levels["mean"][1]) / levels["std"][1] > 0.5
    expected[:, :2] = True
    expected[:, N - 8 :] = True
    assert torch.equal(kept.to_mask(N), expected)
    assert not torch.equal(expected, raw > 0.5)  # the layer's level moved the threshold


def test_a_layer_scoped_threshold_needs_a_threshold_and_a_scorer_with_levels() -> None:
    with pytest.raises(ValueError, match="threshold_scope='layer' needs a threshold"):
        build_policy("kvzap", threshold_scope="layer")
    with pytest.raises(ValueError, match="threshold_scope='head' is not valid; valid: global, layer"):
        build_policy("kvzap", threshold=0.0, threshold_scope="head")
    policy = build_policy("kvzap", window=8, sinks=2, threshold=0.0, threshold_scope="layer")
    with pytest.raises(ValueError, match="records no per-layer score levels.*score_levels MODEL DIR"):
        policy.select(random_layer(kv_heads=3, n=N, w=1), N)  # the random scorer has none
