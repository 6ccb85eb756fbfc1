"""Decode-time eviction methods: registry, attention over held entries, running statistics, selection."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_kvevict.policies.decode import (
    AttentionStatistics,
    DecodeH2O,
    DecodeRoCo,
    DecodeSnapKV,
    DecodeStreamingLLM,
    HeldLayer,
    ada_caps,
    held_attention,
)
from vllm_kvevict.policies.registry import build_decode_policy, decode_method_names


def brute_force_attention(
    keys: torch.Tensor, key_positions: torch.Tensor, queries: torch.Tensor, query_positions: torch.Tensor
) -> torch.Tensor:
    """[q_heads, T, L] causal softmax over the held entries, one (query head, query) at a time."""
    kv_heads, length, d = keys.shape
    q_heads, num_queries, _ = queries.shape
    group = q_heads // kv_heads
    probs = torch.zeros(q_heads, num_queries, length, dtype=torch.float64)
    for j in range(q_heads):
        h = j // group
        for t in range(num_queries):
            p = int(query_positions[t])
            seen = [i for i in range(length) if 0 <= int(key_positions[h, i]) <= p]
            if p < 0 or not seen:
                continue
            logits = torch.stack([keys[h, i].double() @ queries[j, t].double() / math.sqrt(d) for i in seen])
            probs[j, t, seen] = torch.softmax(logits, dim=0)
    return probs


def padded_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """2 KV heads, 4 query heads (GQA group 2), 10 slots; head 1 holds 7 entries, with a gap."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 10, 8, generator=g) * 2
    key_positions = torch.tensor(
        [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 2, 3, -1, 5, 6, 8, 9, -1, -1]], dtype=torch.int64
    )
    queries = torch.randn(4, 5, 8, generator=g) * 2
    query_positions = torch.tensor([-1, 6, 7, 8, 9])
    return keys, key_positions, queries, query_positions


def statistics_state(sums: list[list[float]], counts: list[list[float]], sq: list[list[float]] | None = None):
    """An AttentionStatistics holding the given per-entry statistics at positions 0..L-1."""
    state = AttentionStatistics(len(sums), "cpu")
    state.fit(torch.arange(len(sums[0])).expand(len(sums), -1).clone())
    state.stats.sums = torch.tensor(sums)
    state.stats.counts = torch.tensor(counts)
    state.stats.sq_sums = torch.tensor(sq) if sq is not None else torch.tensor(sums).square()
    return state


def positions(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


# Registry


def test_registry_names_the_methods() -> None:
    assert decode_method_names() == ["roco", "h2o", "streamingllm", "snapkv", "kvzap", "ada-kvzap"]
    assert isinstance(build_decode_policy("roco", std_ratio=0.25), DecodeRoCo)
    assert build_decode_policy("h2o").name == "h2o"


def test_unknown_method_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'rocco'.*roco, h2o, streamingllm, snapkv"):
        build_decode_policy("rocco")


def test_unknown_parameter_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"budget.*valid parameters: sinks"):
        build_decode_policy("streamingllm", budget=3)


def test_bad_parameter_value_is_named() -> None:
    with pytest.raises(ValueError, match=r"std_ratio=1.5"):
        build_decode_policy("roco", std_ratio=1.5)
    with pytest.raises(ValueError, match=r"kernel=4"):
        build_decode_policy("snapkv", kernel=4)


def test_query_windows() -> None:
    assert build_decode_policy("streamingllm").query_window == 0
    assert build_decode_policy("snapkv", window=16).query_window == 16
    assert build_decode_policy("h2o", max_interval=64).query_window == 64


def test_interval_longer_than_the_kept_queries_is_refused() -> None:
    build_decode_policy("roco", max_interval=64).check_interval(64)
    with pytest.raises(ValueError, match=r"interval=128 exceeds max_interval=64"):
        build_decode_policy("roco", max_interval=64).check_interval(128)


def test_cap_below_the_always_kept_entries_is_refused() -> None:
    keys, key_positions, *_ = padded_case()
    with pytest.raises(ValueError, match=r"cap=3.*>= 4"):
        DecodeStreamingLLM(sinks=4).select(None, HeldLayer(key_positions, keys), 3)


# observe


def test_held_attention_matches_brute_force_with_padding_and_gqa() -> None:
    keys, key_positions, queries, query_positions = padded_case()
    probs, visible = held_attention(keys, key_positions, queries, query_positions)
    expected = brute_force_attention(keys, key_positions, queries, query_positions)
    torch.testing.assert_close(probs.reshape(4, 5, 10).double(), expected, atol=1e-6, rtol=1e-5)
    assert not visible[1, :, 3].any() and not visible[:, 0].any()


def test_observe_folds_group_mean_statistics_like_brute_force() -> None:
    keys, key_positions, queries, query_positions = padded_case()
    policy = DecodeRoCo(window=2)
    state = policy.observe(
        policy.init_state(2, "cpu"), HeldLayer(key_positions, keys), queries, query_positions
    )
    rows = brute_force_attention(keys, key_positions, queries, query_positions).reshape(2, 2, 5, 10).mean(1)
    seen = (key_positions[:, None, :] >= 0) & (key_positions[:, None, :] <= query_positions[None, :, None])
    seen &= (query_positions >= 0)[None, :, None]
    counts = seen.sum(dim=1).double()
    mean = rows.sum(dim=1) / counts.clamp(min=1)
    std = (rows.square().sum(dim=1) / counts.clamp(min=1) - mean.square()).clamp(min=0).sqrt()
    torch.testing.assert_close(state.stats.counts.double(), counts)
    torch.testing.assert_close(state.stats.mean().double(), mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state.stats.std().double(), std, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state.stats.sums.double(), rows.sum(dim=1), atol=1e-6, rtol=1e-5)


def test_observe_skips_queries_already_folded() -> None:
    keys, key_positions, queries, query_positions = padded_case()
    policy = DecodeH2O(window=2)
    once = policy.observe(
        policy.init_state(2, "cpu"), HeldLayer(key_positions, keys), queries, query_positions
    )
    split = policy.init_state(2, "cpu")
    policy.observe(split, HeldLayer(key_positions, keys), queries[:, :3], query_positions[:3])
    policy.observe(split, HeldLayer(key_positions, keys), queries, query_positions)  # overlaps the first call
    torch.testing.assert_close(split.stats.sums, once.stats.sums)
    torch.testing.assert_close(split.stats.counts, once.stats.counts)


def test_keep_compacts_statistics_and_new_slots_start_at_zero() -> None:
    keys, key_positions, queries, query_positions = padded_case()
    policy = DecodeH2O(window=2)
    state = policy.observe(
        policy.init_state(2, "cpu"), HeldLayer(key_positions, keys), queries, query_positions
    )
    before = state.stats.sums.clone()
    kept = torch.tensor([[1, 4, 9], [0, 2, -1]])
    state.keep(kept)
    assert state.positions.tolist() == [[1, 4, 9], [0, 3, -1]]
    torch.testing.assert_close(
        state.stats.sums,
        torch.tensor([[before[0, 1], before[0, 4], before[0, 9]], [before[1, 0], before[1, 2], 0.0]]),
    )
    # The caller appends position 10 after each head's kept entries: head 1's padding slot becomes it.
    state.fit(torch.tensor([[1, 4, 9, 10], [0, 3, 10, -1]]))
    assert state.stats.sums[0, 3] == 0 and state.stats.sums[1, 2] == 0
    assert state.stats.sums[1, 1] == before[1, 2]


# select: hand-computed cases


def test_streamingllm_keeps_sinks_and_newest() -> None:
    policy = DecodeStreamingLLM(sinks=2)
    key_positions = positions([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 2, 3, -1, 5, 6, 8, 9, -1, -1])
    kept, lengths = policy.select(None, HeldLayer(key_positions, torch.zeros(2, 10, 4)), 5)
    assert kept.tolist() == [[0, 1, 7, 8, 9], [0, 4, 5, 6, 7]]
    assert lengths.tolist() == [5, 5]


def test_h2o_keeps_heavy_hitters_and_recent() -> None:
    state = statistics_state([[0.5, 0.1, 0.9, 0.2, 0.0, 0.0]], [[6, 5, 4, 3, 2, 1]])
    kept, lengths = DecodeH2O(window=2).select(
        state, HeldLayer(positions([0, 1, 2, 3, 4, 5]), torch.zeros(1, 6, 4)), 4
    )
    assert kept.tolist() == [[0, 2, 4, 5]] and lengths.tolist() == [4]


def test_roco_ranks_by_mean_where_h2o_ranks_by_sum() -> None:
    # Sums favour the old entry 0; per query that saw them, entry 2 got the most.
    sums, counts = [[0.8, 0.3, 0.25, 0.0]], [[8, 3, 1, 1]]
    key_positions = positions([0, 1, 2, 3])
    h2o = DecodeH2O(window=1).select(
        statistics_state(sums, counts), HeldLayer(key_positions, torch.zeros(1, 4, 2)), 2
    )
    roco = DecodeRoCo(window=1, std_ratio=0.0).select(
        statistics_state(sums, counts), HeldLayer(key_positions, torch.zeros(1, 4, 2)), 2
    )
    assert h2o[0].tolist() == [[0, 3]] and roco[0].tolist() == [[2, 3]]


def test_roco_std_scope_keeps_the_most_volatile_entry() -> None:
    # Means 0.1, 0.1, 0.3; entry 1 has the highest std-dev (sq_sums / count - mean^2).
    state = statistics_state([[0.4, 0.4, 1.2, 0.0]], [[4, 4, 4, 1]], sq=[[0.04, 0.4, 0.36, 0.0]])
    assert int(state.stats.std()[0, :3].argmax()) == 1
    policy = DecodeRoCo(window=1, std_ratio=0.5)
    kept, _ = policy.select(state, HeldLayer(positions([0, 1, 2, 3]), torch.zeros(1, 4, 2)), 3)
    assert kept.tolist() == [[1, 2, 3]]  # one slot by std (1), one by mean (2), the window (3)
    kept, _ = DecodeRoCo(window=1, std_ratio=0.0).select(
        state, HeldLayer(positions([0, 1, 2, 3]), torch.zeros(1, 4, 2)), 3
    )
    assert kept.tolist() == [[0, 2, 3]]  # ties in mean go to the lower slot


def test_roco_sinks_keep_the_first_positions_whatever_their_mean() -> None:
    # Means 0.05, 0.1, 0.3, 0.2: without sinks entries 2 and 3 win the two free slots; one sink keeps entry
    # 0 and leaves one slot, to the best mean (2). The window (1 position) is entry 4.
    state = statistics_state([[0.2, 0.4, 1.2, 0.8, 0.0]], [[4, 4, 4, 4, 1]])
    key_positions = positions([0, 1, 2, 3, 4])
    keys = torch.zeros(1, 5, 2)
    paper, _ = DecodeRoCo(window=1, std_ratio=0.0).select(state, HeldLayer(key_positions, keys), 3)
    sunk, _ = DecodeRoCo(window=1, std_ratio=0.0, sinks=1).select(state, HeldLayer(key_positions, keys), 3)
    assert paper.tolist() == [[2, 3, 4]] and sunk.tolist() == [[0, 2, 4]]
    assert DecodeRoCo(window=1, sinks=4).min_cap == 5
    with pytest.raises(ValueError, match="sinks"):
        DecodeRoCo(sinks=-1)


def test_snapkv_keeps_what_the_window_attends_to() -> None:
    # One query looking straight at entry 1's key; the window (1 position) is the newest entry.
    keys = torch.zeros(1, 5, 4)
    keys[0, 1, 0] = 10.0
    query = torch.zeros(1, 1, 4)
    query[0, 0, 0] = 10.0
    policy = DecodeSnapKV(window=1, kernel=1)
    key_positions = positions([0, 1, 2, 3, 4])
    state = policy.observe(
        policy.init_state(1, "cpu"), HeldLayer(key_positions, keys), query, torch.tensor([4])
    )
    kept, _ = policy.select(state, HeldLayer(key_positions, keys), 2)
    assert kept.tolist() == [[1, 4]]
    pooled = DecodeSnapKV(window=1, kernel=3)
    state = pooled.observe(
        pooled.init_state(1, "cpu"), HeldLayer(key_positions, keys), query, torch.tensor([4])
    )
    kept, _ = pooled.select(state, HeldLayer(key_positions, keys), 3)
    assert kept.tolist() == [[0, 1, 4]]  # max pooling spreads entry 1's score to 0 and 2; tie -> lower


def test_padding_is_never_kept_and_output_is_padded() -> None:
    keys, key_positions, queries, query_positions = padded_case()
    for name in decode_method_names():
        policy = build_decode_policy(name, **({"window": 2} if name != "streamingllm" else {"sinks": 1}))
        held = HeldLayer(key_positions, keys, -keys)  # kvzap reads values too
        state = policy.observe(policy.init_state(2, "cpu"), held, queries, query_positions)
        kept, lengths = policy.select(state, held, torch.tensor([3, 9]))
        assert kept.shape == (2, 9) and lengths.tolist() == [3, 7], name
        assert (kept[0, 3:] == -1).all() and (kept[1, 7:] == -1).all(), name
        held = kept[1, :7]
        assert (key_positions[1, held] >= 0).all() and held.tolist() == sorted(held.tolist()), name


def test_ragged_caps_follow_ada_allocation_with_safeguard() -> None:
    # Head 0 concentrates its mass on one entry, head 1 spreads it: head 1 gets the spare slots.
    sums = [[0.9, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.0]]
    state = statistics_state(sums, [[1] * 8, [1] * 8])
    policy = DecodeH2O(window=1)
    key_positions = torch.arange(8).expand(2, 8).clone()
    caps = ada_caps(policy, state, HeldLayer(key_positions), cap=4, alpha=0.5)
    # Safeguard int(4 * 0.5) = 2 per head, the window counted in it: {7, 0} each. The 4 shared slots go to
    # the best remaining scores of both heads: head 1's 0.2s, so caps 2 and 2 + 4.
    assert caps.tolist() == [2, 6]
    kept, lengths = policy.select(state, HeldLayer(key_positions, torch.zeros(2, 8, 2)), caps)
    assert lengths.tolist() == [2, 6] and kept[0, :2].tolist() == [0, 7]


def test_ragged_caps_never_exceed_what_a_head_holds() -> None:
    state = statistics_state([[0.5, 0.5, 0.5, 0.5], [0.1, 0.1, 0.0, 0.0]], [[1] * 4, [1] * 4])
    key_positions = positions([0, 1, 2, 3], [0, 1, -1, -1])
    caps = ada_caps(DecodeH2O(window=1), state, HeldLayer(key_positions), cap=3, alpha=0.2)
    assert caps.tolist() == [4, 2]


def test_snapkv_scores_do_not_depend_on_where_padding_sits() -> None:
    keys, key_positions, queries, query_positions = padded_case()
    policy = DecodeSnapKV(window=2, kernel=3)
    state = policy.observe(
        policy.init_state(2, "cpu"), HeldLayer(key_positions, keys), queries, query_positions
    )
    # Head 1 again, its held entries packed to the front: same entries, same scores.
    order = torch.tensor([0, 1, 2, 4, 5, 6, 7, 3, 8, 9])
    packed_keys, packed_positions = keys[1:, order], key_positions[1:, order]
    packed = policy.observe(
        policy.init_state(1, "cpu"), HeldLayer(packed_positions, packed_keys), queries[2:], query_positions
    )
    torch.testing.assert_close(packed.values[0, :7], state.values[1, order[:7]])


def test_accumulating_methods_need_only_the_queries_since_the_last_rescore() -> None:
    assert DecodeRoCo(max_interval=128).queries_needed(16) == 16
    assert DecodeSnapKV(window=32).queries_needed(16) == 32
    assert DecodeStreamingLLM().queries_needed(16) == 0
