"""The question echo's vLLM-free parts: where the echo is found, which methods it widens, its attention
against a plain full-sequence attention, and its configuration."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_kvevict.datapath.chat_marks import ChatMarks
from vllm_kvevict.datapath.echo_pass import echo_attention
from vllm_kvevict.datapath.question_echo import (
    QuestionEcho,
    between_echo_tokens,
    echo_policy,
    echo_tokens,
    question_spans,
    user_turn_start,
)
from vllm_kvevict.policies.registry import available_methods, build_policy
from vllm_kvevict.settings.config import EvictionConfig, EvictionConfigError

HEADER = [2, 198, 1, 4093, 198]


DEFAULT_SYSTEM = (1, 9, 9)  # what the template writes before a lone user turn
MARKS = ChatMarks(tuple(HEADER), DEFAULT_SYSTEM)


def test_the_echo_is_the_last_user_turns_first_tokens():
    ids = [*DEFAULT_SYSTEM, *HEADER, 50, 51, 52, 2, 198, *HEADER, 60, 61, 62, 63, 64, 2]
    start = user_turn_start(ids, HEADER)
    assert start == len(ids) - 6
    assert echo_tokens(ids, MARKS, 3) == [60, 61, 62]
    assert echo_tokens(ids, MARKS, 100) == [60, 61, 62, 63, 64, 2]  # what there is
    assert echo_tokens([*DEFAULT_SYSTEM, *HEADER, 60, 61], MARKS, 3) == [60, 61]  # the template's system


def test_an_own_system_message_before_one_user_turn_is_echoed_by_its_end_too():
    ids = [1, 30, 31, 32, 33, *HEADER, 60, 61, 62, 63]
    assert question_spans(ids, MARKS, 3) == [(2, 5), (10, 13)]
    assert echo_tokens(ids, MARKS, 3) == [31, 32, 33, 60, 61, 62]
    assert echo_tokens(ids, MARKS, 8) == [1, 30, 31, 32, 33, 60, 61, 62, 63]  # the span stops at the header
    later_turn = [1, 30, 31, *HEADER, 50, 2, 198, *HEADER, 60, 61]  # a conversation: the last turn only
    assert echo_tokens(later_turn, MARKS, 3) == [60, 61]
    no_default = ChatMarks(tuple(HEADER), None)  # a template with no system message of its own
    assert echo_tokens([1, 30, *HEADER, 60], no_default, 2) == [1, 30, 60]


def test_between_chunks_the_echo_is_the_question_spans_and_the_prompts_last():
    document = list(range(100, 140))
    ids = [*DEFAULT_SYSTEM, *HEADER, 60, 61, 62, *document, 70, 71, 72]
    assert between_echo_tokens(ids, MARKS, 3) == [60, 61, 62, 70, 71, 72]
    short = [*DEFAULT_SYSTEM, *HEADER, 60, 61, 62, 63]  # the two spans overlap: their union, once
    assert between_echo_tokens(short, MARKS, 3) == [60, 61, 62, 63]
    assert between_echo_tokens(short, MARKS, 5) == [198, 60, 61, 62, 63]
    own_system = [1, 30, 31, *HEADER, *document, 70, 71]
    assert between_echo_tokens(own_system, MARKS, 2) == [30, 31, 100, 101, 70, 71]


@pytest.mark.parametrize("ids", [[5, 6, 7, 8], [2, 198, 1, 4093], list(range(10, 60))])
def test_a_prompt_without_the_header_is_echoed_by_its_head(ids):
    assert user_turn_start(ids, HEADER) is None
    assert echo_tokens(ids, MARKS, 32) == ids[:32]
    assert between_echo_tokens(ids, MARKS, 2) == ids[:2] + ids[-2:]
    assert echo_tokens([*HEADER, 3], ChatMarks(), 32) == [*HEADER, 3]  # no header known: the head
    assert echo_tokens([7, *ids], ChatMarks(bos=7), 3) == ids[:3]  # after the BOS
    assert echo_tokens([], MARKS, 32) == [] and between_echo_tokens([], MARKS, 32) == []


@pytest.mark.parametrize("method", ["snapkv", "ada-snapkv", "pyramidkv", "critical-ada-snapkv", "nacl"])
def test_windowed_methods_widen_their_window_by_the_echo(method):
    policy = build_policy(method)
    widened = echo_policy(policy, 32)
    assert widened is not None and widened.name == policy.name
    assert widened.query_window(10_000) == policy.query_window(10_000) + 32
    assert type(widened) is type(policy)
    assert policy.query_window(10_000) == 32  # the original is untouched
    # it keeps its own window only: the echo's tokens are no prompt tokens
    assert torch.equal(widened.always_kept(1000, 100), policy.always_kept(1000, 100))


def test_methods_without_a_bounded_window_have_no_echo():
    windowed = {info.name for info in available_methods() if echo_policy(build_policy(info.name), 8)}
    assert {"snapkv", "ada-snapkv", "nacl"} <= windowed
    assert windowed.isdisjoint({"streamingllm", "h2o", "knorm", "keydiff", "expected-attention"})


def test_question_echo_builds_one_widened_policy_per_policy():
    echo = QuestionEcho(16, MARKS)
    policy = build_policy("ada-snapkv")
    first = echo.policy_for(policy, 16)
    assert first is echo.policy_for(policy, 16)
    assert echo.policy_for(policy, 8).query_window(10_000) == 40  # a request's own width
    assert echo.policy_for(build_policy("streamingllm"), 16) is None
    assert echo.tokens([*HEADER, 7, 8, 9], 2) == [7, 8]


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_echo_attention_equals_attention_over_the_whole_sequence(softcap):
    """The echo attends to every held entry and causally to itself: the rows of the echo in a plain causal
    attention over [held, echo] (GQA by repeating KV heads)."""
    gen = torch.Generator().manual_seed(0)
    heads, group, held, width, dim = 2, 3, 11, 5, 8
    q = torch.randn(width, heads * group, dim, generator=gen)
    k_held, v_held = torch.randn(2, heads, held, dim, generator=gen)
    k_echo, v_echo = torch.randn(2, width, heads, dim, generator=gen)
    scale = dim**-0.5
    got = echo_attention(q, k_held, v_held, k_echo, v_echo, scale, softcap)

    keys = torch.cat([k_held, k_echo.transpose(0, 1)], dim=1).repeat_interleave(group, dim=0)
    values = torch.cat([v_held, v_echo.transpose(0, 1)], dim=1).repeat_interleave(group, dim=0)
    scores = torch.einsum("qhd,hkd->hqk", q, keys) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    positions = torch.arange(held + width)
    visible = positions[None, :] <= (held + torch.arange(width))[:, None]
    expected = torch.einsum("hqk,hkd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_config_takes_question_echo_and_refuses_bad_values():
    config = EvictionConfig.from_dict({"method": "ada-snapkv", "budget": 0.25, "question_echo": 32})
    assert config.question_echo == 32
    assert EvictionConfig.from_dict(config.to_dict()) == config
    assert "question_echo=32" in config.describe()
    off = EvictionConfig.from_dict({"method": "ada-snapkv", "budget": 0.25, "question_echo": 0})
    assert off.question_echo == 0 and EvictionConfig.from_dict(off.to_dict()) == off
    assert "question_echo" not in off.describe()


def test_the_echo_between_chunks_is_opt_in_and_needs_the_echo():
    base = {"method": "ada-snapkv", "budget": 0.25, "prefill": "chunked"}
    assert EvictionConfig.from_dict(base).echo_between_chunks is False
    assert QuestionEcho(32, MARKS).between_chunks is False
    config = EvictionConfig.from_dict({**base, "echo_between_chunks": True})
    assert config.echo_between_chunks and EvictionConfig.from_dict(config.to_dict()) == config
    assert "(also between chunks)" in config.describe()
    with pytest.raises(
        EvictionConfigError, match=r"echo_between_chunks='yes' is not valid; valid: true, false"
    ):
        EvictionConfig.from_dict({**base, "echo_between_chunks": "yes"})
    with pytest.raises(EvictionConfigError, match=r"echo_between_chunks=true needs the question echo"):
        EvictionConfig.from_dict({**base, "echo_between_chunks": True, "question_echo": 0})


@pytest.mark.parametrize(
    ("method", "width"), [("ada-snapkv", 32), ("snapkv", 32), ("streamingllm", 0), ("h2o", 0)]
)
def test_the_echo_is_on_by_default_where_the_method_judges_by_a_window(method, width):
    assert EvictionConfig(method=method, budget=0.25).question_echo == width


def test_bad_question_echo_values_are_refused():
    for bad in (-1, 1.5, True, "32"):
        with pytest.raises(EvictionConfigError, match=r"question_echo=.* is not valid; use an integer >= 0"):
            EvictionConfig(method="snapkv", budget=0.25, question_echo=bad)
    with pytest.raises(EvictionConfigError, match=r"'streamingllm', which judges no query window; valid"):
        EvictionConfig(method="streamingllm", budget=0.25, question_echo=32)


@pytest.mark.parametrize("method", ["snapkv", "ada-snapkv", "nacl"])
def test_the_echo_queries_decide_what_the_window_alone_would_not_keep(method):
    """Echo queries placed after the prompt that point at one early key make the method keep it; the window
    queries alone (pointing elsewhere) do not. The last window stays kept either way."""
    from vllm_kvevict.policies.base import LayerKV

    gen = torch.Generator().manual_seed(3)
    heads, n, dim, window, echo = 2, 200, 16, 32, 8
    keys = torch.randn(heads, n, dim, generator=gen)
    target = 40
    window_queries = torch.randn(heads, window, dim, generator=gen) * 0.1
    echo_queries = keys[:, target : target + 1].expand(heads, echo, dim) * 4.0
    budget = 48
    plain = build_policy(method, window=window)
    layer = LayerKV(keys=keys, values=torch.randn(heads, n, dim, generator=gen), queries=window_queries)
    echoed_layer = dataclasses.replace(
        layer,
        queries=torch.cat([window_queries, echo_queries], dim=1),
        query_positions=torch.arange(n - window, n + echo),
    )
    kept_plain = plain.select(layer, budget)
    kept_echo = echo_policy(plain, echo).select(echoed_layer, budget)
    for head in range(heads):
        assert target in kept_echo.head(head).tolist()
        assert set(range(n - window, n)) <= set(kept_echo.head(head).tolist())
    assert not all(target in kept_plain.head(h).tolist() for h in range(heads))
