"""The decode form of a prefill scorer (``ScoredDecode``: kvzap, ada-kvzap at decode time) against a plain
torch reference: what each head keeps is its top-``cap`` of the learned scorer's scores over the entries it
holds, with sinks and its newest entries kept and padding never kept; Ada caps split the layer's slots."""

from __future__ import annotations

import pytest
import torch
from learned_scorers import random_scorer

from vllm_kvevict.policies.decode import HeldLayer, ScoredDecode
from vllm_kvevict.policies.decode.decode_policy import ada_caps_from_scores
from vllm_kvevict.policies.knorm import KNorm
from vllm_kvevict.policies.kvzap import KVzap
from vllm_kvevict.policies.registry import build_decode_policy

HEADS, D, LAYERS, LAYER = 3, 8, 4, 2
SINKS, WINDOW = 2, 4


def held_case(seed: int = 0, width: int = 40) -> HeldLayer:
    """3 heads holding 40, 31 and 25 entries at ascending positions with gaps, then the newest WINDOW
    (296-299); head 0 holds the sinks, head 2 never held them; padding after each head's entries, its rows
    huge or NaN (they must not matter)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.full((HEADS, width), -1, dtype=torch.int64)
    old = 300 - WINDOW  # positions before the window
    for h, count in enumerate((width, 31, 25)):
        if h == 0:
            drawn = torch.cat([torch.arange(SINKS), SINKS + torch.randperm(old - SINKS, generator=g)])
        elif h == 1:
            drawn = torch.randperm(old, generator=g)
        else:
            drawn = SINKS + torch.randperm(old - SINKS, generator=g)
        chosen = drawn[: count - WINDOW].sort().values
        positions[h, :count] = torch.cat([chosen, torch.arange(old, 300)])
    keys = torch.randn(HEADS, width, D, generator=g)
    values = torch.randn(HEADS, width, D, generator=g)
    keys[positions < 0] = 1e30
    values[positions < 0] = float("nan")
    return HeldLayer(positions, keys, values, LAYER, LAYERS)


def reference_scores(held: HeldLayer) -> torch.Tensor:
    """[H, L] the scorer's raw scores of the held entries (padding: -inf), one head at a time."""
    scorer = random_scorer(LAYERS, HEADS, D)  # what the unit tests serve for layers of this shape
    scores = torch.full(held.positions.shape, float("-inf"))
    for h in range(HEADS):
        count = int(held.valid[h].sum())
        keys = torch.zeros(HEADS, count, D)
        values = torch.zeros(HEADS, count, D)
        keys[h], values[h] = held.keys[h, :count], held.values[h, :count]
        scores[h, :count] = scorer.layer_scores(LAYER, keys, values)[h]
    return scores


def reference_kept(held: HeldLayer, caps: list[int]) -> list[set[int]]:
    """Per head, the positions kept: sinks and the newest WINDOW first, then the best raw scores."""
    raw = reference_scores(held)
    kept = []
    for h, cap in enumerate(caps):
        entries = [(int(p), float(raw[h, i])) for i, p in enumerate(held.positions[h]) if p >= 0]
        newest = max(p for p, _ in entries)
        forced = [p for p, _ in entries if p < SINKS or p > newest - WINDOW]
        rest = sorted((e for e in entries if e[0] not in forced), key=lambda e: -e[1])
        kept.append(set(forced[:cap]) | {p for p, _ in rest[: max(0, cap - len(forced))]})
    return kept


def kept_positions(held: HeldLayer, kept: torch.Tensor) -> list[set[int]]:
    return [{int(held.positions[h, i]) for i in kept[h] if i >= 0} for h in range(HEADS)]


@pytest.mark.parametrize("cap", [10, 20, 30])
def test_each_head_keeps_its_top_cap_of_the_scorers_scores_over_what_it_holds(cap: int) -> None:
    held = held_case()
    policy = build_decode_policy("kvzap", window=WINDOW, sinks=SINKS)
    kept, lengths = policy.select(None, held, cap)
    expected = reference_kept(held, [cap] * HEADS)
    assert kept_positions(held, kept) == expected
    assert lengths.tolist() == [min(cap, int(n)) for n in held.valid.sum(dim=1)]
    assert all(row[row >= 0].tolist() == sorted(set(row[row >= 0].tolist())) for row in kept)


def test_scores_are_the_scorers_with_padding_minus_inf_and_sinks_and_window_plus_inf() -> None:
    held = held_case(seed=1)
    scores = build_decode_policy("kvzap", window=WINDOW, sinks=SINKS).scores(None, held)
    raw = reference_scores(held)
    newest = held.positions.amax(dim=1, keepdim=True)
    forced = held.valid & ((held.positions < SINKS) | (held.positions > newest - WINDOW))
    assert torch.isinf(scores[forced]).all() and (scores[forced] > 0).all()
    assert (scores[~held.valid] == float("-inf")).all()
    rest = held.valid & ~forced
    torch.testing.assert_close(scores[rest], raw[rest])
    assert forced[0].sum() == SINKS + WINDOW and forced[2].sum() == WINDOW  # head 2 holds no sink


def test_padding_is_never_kept_even_when_a_cap_exceeds_a_heads_entries() -> None:
    held = held_case(seed=2)
    kept, lengths = build_decode_policy("kvzap", window=WINDOW, sinks=SINKS).select(
        None, held, torch.tensor([35, 35, 35])
    )
    assert lengths.tolist() == [35, 31, 25]
    assert kept_positions(held, kept) == reference_kept(held, [35, 31, 25])
    assert (kept[2, 25:] == -1).all()


@pytest.mark.parametrize(("alpha", "cap"), [(0.2, 12), (0.5, 20)])
def test_ada_kvzap_splits_the_layers_caps_by_the_same_scores(alpha: float, cap: int) -> None:
    held = held_case(seed=3)
    policy = build_decode_policy("ada-kvzap", window=WINDOW, sinks=SINKS, alpha=alpha)
    caps = policy.layer_caps(None, held, cap, "uniform")  # the method's Ada caps, whatever the server says
    assert isinstance(caps, torch.Tensor) and int(caps.sum()) == HEADS * cap
    assert len(set(caps.tolist())) > 1  # ragged
    newest = held.positions.amax(dim=1, keepdim=True)
    always = held.valid & ((held.positions < SINKS) | (held.positions > newest - WINDOW))
    scores = reference_scores(held).masked_fill(always, float("inf"))
    assert caps.tolist() == ada_caps_from_scores(scores, held.positions, cap, alpha).tolist()
    kept, lengths = policy.select(None, held, caps)
    assert lengths.tolist() == caps.tolist()
    assert kept_positions(held, kept) == reference_kept(held, caps.tolist())


def test_kvzap_takes_the_servers_ada_allocation_and_uniform_otherwise() -> None:
    held = held_case(seed=4)
    policy = build_decode_policy("kvzap", window=WINDOW, sinks=SINKS)
    assert policy.layer_caps(None, held, 12, "uniform") == 12
    caps = policy.layer_caps(None, held, 12, "ada")
    assert int(caps.sum()) == HEADS * 12 and len(set(caps.tolist())) > 1


def test_registry_entries_parameters_and_refusals() -> None:
    policy = build_decode_policy("kvzap", window=WINDOW, sinks=SINKS)
    assert isinstance(policy, ScoredDecode) and policy.inner == KVzap(window=WINDOW, sinks=SINKS)
    assert policy.name == "kvzap" and policy.min_cap == WINDOW + SINKS and policy.query_window == 0
    assert policy.reads_keys and policy.reads_values
    with pytest.raises(ValueError, match=r"threshold.*valid parameters: scorer, window, sinks$"):
        build_decode_policy("kvzap", threshold=-2.0)
    with pytest.raises(ValueError, match=r"alpha=1.5"):
        build_decode_policy("ada-kvzap", alpha=1.5)
    with pytest.raises(ValueError, match=r"cap=5.*>= 6"):
        policy.select(None, held_case(), 5)
    with pytest.raises(ValueError, match=r"entry_scores"):
        ScoredDecode(KNorm())  # its scores take neighbours' (span_after): not one entry's row
    with pytest.raises(ValueError, match=r"reads the held values"):
        policy.scores(None, HeldLayer(held_case().positions, held_case().keys, None, LAYER, LAYERS))
