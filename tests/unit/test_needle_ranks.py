"""The ranking helpers of the HF runner's question-agnostic benchmarks: where an answer ranks per head
(``needle_ranks``), the kept set of scores ranked across layers (``learned_grid --global-rows``, a kept
context's HF column in ``kept_context``) and the server parameters ``kept_context`` reads."""

from __future__ import annotations

import torch


class CharTokenizer:
    """One id per character (ord), enough for finding an answer's tokens in a prompt."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_answer_positions_finds_the_answer_with_or_without_its_space() -> None:
    from benchmarks.policy_quality.needle_ranks import answer_positions

    tokenizer = CharTokenizer()
    prompt = tokenizer.encode("the number is 4271.")
    assert answer_positions(prompt, ["4271"], tokenizer) == [13, 14, 15, 16, 17]  # " 4271" first
    assert answer_positions(tokenizer.encode("x:4271"), ["4271"], tokenizer) == [2, 3, 4, 5]
    assert answer_positions(prompt, ["9999", "number"], tokenizer) == list(range(3, 10))
    assert answer_positions(prompt, ["9999"], tokenizer) == []


def test_rank_shares_count_the_tokens_strictly_above() -> None:
    from benchmarks.policy_quality.needle_ranks import rank_shares

    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0], [1.0, float("inf"), 1.0, 2.0, 0.0]])
    shares = rank_shares(scores, [0, 4])
    assert torch.allclose(shares, torch.tensor([[0.0, 0.8], [0.4, 0.8]]))


def test_top_quarter_overlap_of_equal_and_opposite_rankings() -> None:
    from benchmarks.policy_quality.needle_ranks import top_quarter_overlap

    target = torch.arange(16.0).repeat(2, 1)
    assert top_quarter_overlap(target, target, start=0) == 1.0
    assert top_quarter_overlap(-target, target, start=0) == 0.0
    # from ``start`` on only: the first 8 tokens do not count
    shifted = torch.cat([torch.full((2, 8), 100.0), torch.arange(8.0).repeat(2, 1)], dim=1)
    assert top_quarter_overlap(shifted, shifted, start=8) == 1.0


def test_kept_across_layers_keeps_the_total_best_and_every_always_kept_entry() -> None:
    from vllm_kvevict.datapath.pooled_eviction import kept_across_layers

    inf = float("inf")
    layer0 = torch.tensor([[inf, 0.1, 0.2, 0.3], [inf, 9.0, 8.0, 0.0]])
    layer1 = torch.tensor([[inf, 7.0, 0.4, 6.0], [inf, 0.5, 0.6, 0.7]])
    kept = kept_across_layers([layer0, layer1], (2, 2), heads=2, length=4)  # 2 heads x (2 + 2) = 8 in all
    assert sum(layer.total for layer in kept) == 8
    assert kept[0].head(0).tolist() == [0]
    assert kept[0].head(1).tolist() == [0, 1, 2]
    assert kept[1].head(0).tolist() == [0, 1, 3]
    assert kept[1].head(1).tolist() == [0]


def test_level_budgets_keep_the_plans_total_and_give_higher_levels_more() -> None:
    from benchmarks.policy_quality.learned_grid import level_budgets

    levels = {"mean": [-6.0, -4.0, -2.0, -4.0], "std": [1.0, 1.0, 1.0, 2.0]}
    budgets = level_budgets(levels, [300] * 4, num_tokens=1000, floor=36)
    assert sum(budgets) == 1200 and all(36 <= b <= 1000 for b in budgets)
    assert budgets[0] < budgets[1] < budgets[2]  # same spread, higher level: more kept
    assert budgets[3] > budgets[1]  # same level, wider spread: more above a threshold over the level
    assert level_budgets(levels, [1000] * 4, 1000, 36) == [1000] * 4  # everything kept
    even = {"mean": [-3.0] * 3, "std": [1.0] * 3}
    assert level_budgets(even, [100, 200, 300], 1000, 36) == [200, 200, 200]  # equal levels: equal shares


def test_entries_below_a_threshold_are_never_kept_and_the_total_shrinks() -> None:
    from vllm_kvevict.datapath.pooled_eviction import kept_across_layers

    inf = float("inf")
    layer0 = torch.tensor([[inf, -inf, 0.2, -inf], [inf, 9.0, -inf, -inf]])
    layer1 = torch.tensor([[inf, 7.0, -inf, 6.0], [inf, -inf, -inf, -inf]])
    kept = kept_across_layers([layer0, layer1], (2, 2), heads=2, length=4)  # 8 allowed, 7 above -inf
    assert [k.head(h).tolist() for k in kept for h in range(2)] == [[0, 2], [0, 1], [0, 1, 3], [0]]
    capped = kept_across_layers([layer0, layer1], (1, 1), heads=2, length=4)  # 4 allowed
    assert [k.head(h).tolist() for k in capped for h in range(2)] == [[0], [0], [0], [0]]


def test_the_hf_ranking_across_layers_of_a_kept_context_keeps_whole_sub_blocks() -> None:
    from vllm_kvevict.hf_reference import kept_ranked_across_layers
    from vllm_kvevict.policies.base import LayerKV
    from vllm_kvevict.policies.registry import build_policy

    g = torch.Generator().manual_seed(0)
    policy = build_policy("kvzap", window=4, sinks=2, budget_scope="model", scorer=None).kept_context_form(8)
    assert policy is not None and policy.head_unit == 8
    layers = [
        LayerKV(keys=torch.randn(2, 64, 16, generator=g) * (1 + 3 * i),
                values=torch.randn(2, 64, 16, generator=g), queries=torch.zeros(2, 0, 16), layer_idx=i,
                num_layers=3)
        for i in range(3)
    ]  # fmt: skip
    policy.score = lambda layer, budget: layer.keys.norm(dim=-1)  # a stand-in scorer: the key's length
    kept = kept_ranked_across_layers(policy, layers, [16, 16, 16], unit=8)
    counts = torch.stack([k.counts for k in kept])
    assert int(counts.sum()) == 2 * 48 and bool((counts % 8 == 0).all())
    assert counts[2].sum() > counts[0].sum()  # the layer with longer keys keeps more


def test_kept_context_reads_the_eviction_servers_method_parameters() -> None:
    import json
    from pathlib import Path

    import vllm_kvevict
    from benchmarks.kept_context import server_method

    scorer = str(Path(vllm_kvevict.__file__).parent / "scorers" / "smollm2-135m-instruct-linear")
    config = json.dumps({"budget_scope": "model", "scorer": scorer, "prefill": "chunked"})
    flags = ("--kv-eviction", "kvzap", "--kv-budget", "0.25", "--kv-eviction-config", config)
    assert server_method(flags) == ("kvzap", {"budget_scope": "model", "scorer": scorer})
    assert server_method(("--kv-eviction", "snapkv", "--kv-budget", "0.25")) == ("snapkv", {})


class FixedScores:
    """A policy whose scores [H, n] are given per layer index."""

    def __init__(self, scores: list[torch.Tensor]) -> None:
        self.scores = scores

    def score(self, layer, budget: int) -> torch.Tensor:
        return self.scores[layer.layer_idx]


class FakeLayer:
    def __init__(self, layer_idx: int, num_tokens: int) -> None:
        self.layer_idx = layer_idx
        self.num_tokens = num_tokens


def test_spans_kept_scores_the_question_spans_first_and_leaves_the_rest() -> None:
    from benchmarks.policy_quality.learned_grid import SpansKept

    base = torch.arange(8.0).repeat(2, 1)
    scored = SpansKept(FixedScores([base]), ((1, 3), (6, 7))).score(FakeLayer(0, 8), budget=4)
    inf = float("inf")
    assert scored[0].tolist() == [0.0, inf, inf, 3.0, 4.0, 5.0, inf, 7.0]
    assert torch.equal(scored[0], scored[1])
    assert base[0, 1] == 1.0  # the policy's own scores are not changed


def test_echo_kept_keeps_each_heads_top_share_by_the_echo_in_every_layer() -> None:
    from benchmarks.policy_quality.learned_grid import EchoKept

    learned = FixedScores([torch.zeros(2, 8), torch.zeros(2, 8)])
    echo = FixedScores([torch.tensor([[0.0, 5, 1, 1, 1, 9, 1, 1], [7.0, 1, 1, 1, 8, 1, 1, 1]])] * 2)
    kept = EchoKept(learned, echo, [FakeLayer(0, 8), FakeLayer(1, 8)], share=0.2)  # ceil(1.6) = 2 per head
    for layer_idx in (0, 1):
        scored = kept.score(FakeLayer(layer_idx, 8), budget=2)
        assert torch.isinf(scored[0]).nonzero().flatten().tolist() == [1, 5]
        assert torch.isinf(scored[1]).nonzero().flatten().tolist() == [0, 4]
        assert int(torch.isinf(scored).sum()) == 4
