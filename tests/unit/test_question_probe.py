"""The question probe's token choice and its queries (``hf_reference.probe``) on the bundled model."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.model]


@pytest.fixture(scope="module")
def reference(model_dir):
    from vllm_kvevict.hf_reference import load_reference_model

    return load_reference_model(model_dir)


def chat(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered)["input_ids"]


def test_the_probe_takes_both_ends_of_the_last_user_turn(reference):
    from vllm_kvevict.hf_reference.probe import head_tokens, probe_tokens

    _, tokenizer = reference
    question = "What is the magic number for the blue door?"
    ids = chat(tokenizer, question + " " + " ".join(f"line {i} of the text." for i in range(200)))
    start = next(i for i in range(len(ids) - 3, 0, -1) if tokenizer.decode(ids[i : i + 3]) == "What is the")
    assert head_tokens(ids, tokenizer, 16) == ids[start : start + 16]
    probe = probe_tokens(ids, tokenizer, 16)
    assert probe == ids[start : start + 16] + ids[-16:]
    short = chat(tokenizer, "Hi there")  # the two spans overlap: their union, once
    union_start = min(len(short) - len(head_tokens(short, tokenizer, 16)), len(short) - 16)
    assert probe_tokens(short, tokenizer, 16) == short[union_start:]
    assert probe_tokens([5, 6, 7, 8, 9], tokenizer, 2) == [5, 6, 8, 9]  # no user header: both ends
    assert probe_tokens(tuple(ids), tokenizer, 16) == probe  # an eval sample's token ids are a tuple


def test_the_echo_finds_the_question_in_each_placement_of_the_eval_families(reference, model_dir):
    """The served rule on the bundled tokenizer: a chat prompt's user turn (the template's own system
    message is not echoed), an application's system message before one user turn, a plain completion."""
    from vllm_kvevict.evaluation.generate import generate_sample
    from vllm_kvevict.evaluation.prompt_format import PromptFormat
    from vllm_kvevict.evaluation.tasks import get_task
    from vllm_kvevict.hf_reference.probe import head_tokens

    _, tokenizer = reference
    fmt = PromptFormat.from_path(model_dir)
    echoed = {}
    for family in ("", "qfirst_", "qsystem_", "rag_"):
        sample = generate_sample(get_task(f"{family}niah_single_essay"), fmt, 1024, 0, 0)
        echoed[family] = tokenizer.decode(head_tokens(sample.token_ids, tokenizer, 32))
        assert len(head_tokens(sample.token_ids, tokenizer, 32)) == (64 if family == "qsystem_" else 32)
    assert echoed[""].startswith("Some special magic numbers") and "SmolLM" not in echoed[""]
    assert "What is the special magic number for" in echoed["qfirst_"]
    system, user = echoed["qsystem_"].split("provided text?")
    assert "What is the special magic number for" in system and "SmolLM" not in system
    assert user.strip() and "magic" not in user  # the document's first tokens
    assert echoed["rag_"].startswith("Some special magic") and "Question: What is" in echoed["rag_"]


def test_probe_queries_are_those_of_the_tokens_alone_at_the_given_positions(reference):
    """Run alone at positions p.., the probe's queries equal a prefill of the same tokens that starts at p
    (RoPE by position; no context): checked against a plain prefill at position 0 for p = 0."""
    from vllm_kvevict.hf_reference import prefill
    from vllm_kvevict.hf_reference.probe import probe_queries, probed_layers

    model, tokenizer = reference
    tokens = tokenizer("The blue door hides the number")["input_ids"]
    at_zero = probe_queries(model, tokens, 0)
    plain = prefill(model, torch.tensor(tokens)).layers
    for queries, layer in zip(at_zero, plain, strict=True):
        torch.testing.assert_close(queries, layer.queries, rtol=1e-4, atol=1e-5)
    later = probe_queries(model, tokens, 500)
    assert not torch.allclose(later[3], at_zero[3])  # RoPE moved them
    probed = probed_layers(plain, later)
    assert probed[0].positions().tolist() == list(range(len(tokens), 2 * len(tokens)))
    both = probed_layers(plain, later, window=2)  # the prompt's own last 2 queries, then the probe's
    n = len(tokens)
    assert both[0].positions().tolist() == [n - 2, n - 1, *range(n, 2 * n)]
    torch.testing.assert_close(both[0].queries[:, :2], plain[0].queries[:, -2:])


def test_echo_queries_are_those_of_the_tokens_run_after_the_whole_prompt(reference):
    """An echo of tokens t after prompt p has the queries the last |t| positions of a prefill of p + t have
    (every layer read p), and it leaves p's cache as it was."""
    from vllm_kvevict.hf_reference import prefill
    from vllm_kvevict.hf_reference.probe import echo_queries, probe_queries

    model, tokenizer = reference
    prompt = tokenizer("The blue door hides the number 4417. The red door hides nothing at all.")["input_ids"]
    echo = tokenizer(" Which door hides the number?")["input_ids"]
    prefilled = prefill(model, torch.tensor(prompt))
    keys_before = [k.clone() for k in prefilled.keys]
    echoed = echo_queries(model, prefilled, echo)
    joined = prefill(model, torch.tensor(prompt + echo)).layers
    for queries, layer in zip(echoed, joined, strict=True):
        torch.testing.assert_close(queries, layer.queries[:, -len(echo) :], rtol=1e-4, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(keys_before, prefilled.keys, strict=True))
    alone = probe_queries(model, echo, len(prompt))  # the same tokens without the prompt differ past layer 0
    assert not torch.allclose(alone[5], echoed[5], atol=1e-3)
