"""Careless and hostile requests against a server with eviction (issue 13, item 1).

Each one is answered with a 4xx whose message names the problem, or with a valid response; never a 5xx, a
dead engine or a leaked block. The last test checks the server after all of them.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
from reliability_traffic import (
    BUDGET,
    MAX_MODEL_LEN,
    USAGE,
    long_ids,
    long_text,
    wait_for_usage_zero,
    wait_for_worker_state_empty,
)
from request_bodies import client_of

pytestmark = [pytest.mark.e2e, pytest.mark.model]

COMPACTED_TOKENS = 400  # > BUDGET: every prompt of this length is compacted


def post(server, path: str, body: object, timeout_s: float = 300) -> httpx.Response:
    """POST raw JSON (or raw bytes) with httpx: the openai client would validate some bodies itself."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, timeout=timeout_s,
                      headers={"Content-Type": "application/json"})


def completion(server, **fields) -> httpx.Response:
    return post(server, "/completions", {"model": server.served_model_name, **fields})


def assert_clear_4xx(response: httpx.Response, *words: str) -> str:
    """A 4xx with an OpenAI-style error whose message names every one of ``words``; returns the message."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    message = response.json()["error"]["message"]
    for word in words:
        assert word.lower() in message.lower(), (word, message)
    return message


def assert_valid_completion(response: httpx.Response, choices: int = 1) -> dict:
    assert response.status_code == 200, (response.status_code, response.text[:500])
    body = response.json()
    assert len(body["choices"]) == choices
    assert all(isinstance(choice["text"], str) for choice in body["choices"])
    return body


# -- prompts ----------------------------------------------------------------------------------------------
def test_empty_prompt_is_refused_by_name(server):
    assert_clear_4xx(completion(server, prompt="", max_tokens=4), "prompt", "empty")


def test_one_token_prompt_is_answered(server):
    body = assert_valid_completion(completion(server, prompt=[1], max_tokens=4, temperature=0))
    assert body["usage"]["prompt_tokens"] == 1


def test_prompt_over_the_context_length_is_refused_naming_the_limit(server, tokenizer):
    ids = long_ids(tokenizer, MAX_MODEL_LEN + 10, seed=1)
    response = completion(server, prompt=ids, max_tokens=4)
    assert_clear_4xx(response, "maximum context length", str(MAX_MODEL_LEN))


def test_max_tokens_past_the_context_length_is_cut_at_the_context_length(server, tokenizer):
    ids = long_ids(tokenizer, MAX_MODEL_LEN - 10, seed=2)
    body = assert_valid_completion(completion(server, prompt=ids, max_tokens=100, temperature=0))
    assert body["usage"]["total_tokens"] <= MAX_MODEL_LEN
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(
    ("token_id", "words"),
    [(10**7, ("10000000", "vocabulary")), (-1, ("prompt.2", "greater than"))],
)
def test_out_of_vocabulary_token_ids_are_refused_by_value(server, token_id, words):
    assert_clear_4xx(completion(server, prompt=[1, 2, token_id], max_tokens=4), *words)


# -- sampling parameters ----------------------------------------------------------------------------------
def test_absurd_max_tokens_is_refused_naming_the_limit(server):
    assert_clear_4xx(completion(server, prompt="Hello", max_tokens=10**9), str(MAX_MODEL_LEN))


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", -5), ("temperature", -1.0), ("n", 0), ("logprobs", 10**6), ("top_p", 7.0)],
)
def test_out_of_range_parameter_is_refused_by_name(server, field, value):
    assert_clear_4xx(completion(server, prompt="Hello", **{"max_tokens": 4, field: value}), field)


def test_n_samples_of_a_compacted_prompt_are_all_answered(server, tokenizer):
    ids = long_ids(tokenizer, COMPACTED_TOKENS, seed=3)
    body = assert_valid_completion(
        completion(server, prompt=ids, max_tokens=12, n=3, temperature=1.0, seed=7), choices=3
    )
    assert body["usage"]["completion_tokens"] > 0


def test_logprobs_of_a_compacted_prompt_cover_every_generated_token(server, tokenizer):
    ids = long_ids(tokenizer, COMPACTED_TOKENS, seed=4)
    body = assert_valid_completion(completion(server, prompt=ids, max_tokens=8, temperature=0, logprobs=3))
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == body["usage"]["completion_tokens"]
    assert all(len(top) <= 3 + 1 and value <= 0 for top, value in
               zip(logprobs["top_logprobs"], logprobs["token_logprobs"], strict=True))


def test_prompt_logprobs_and_echo_of_a_compacted_prompt_cover_the_whole_prompt(server, tokenizer):
    ids = long_ids(tokenizer, COMPACTED_TOKENS, seed=5)
    body = assert_valid_completion(
        completion(server, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=1, prompt_logprobs=1)
    )
    choice = body["choices"][0]
    # echo: the prompt's tokens come first, the first one without a log-probability (nothing precedes it).
    assert len(choice["logprobs"]["tokens"]) == COMPACTED_TOKENS + body["usage"]["completion_tokens"]
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert len(choice["prompt_logprobs"]) == COMPACTED_TOKENS


def test_json_schema_output_on_a_compacted_prompt_follows_the_schema(server, tokenizer):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    question = long_text(tokenizer, COMPACTED_TOKENS, seed=6) + "\nWas a lantern mentioned? Reply in JSON."
    response_format = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": schema}}
    result = client_of(server).chat.completions.create(
        model=server.served_model_name, messages=[{"role": "user", "content": question}], max_tokens=32,
        temperature=0, response_format=response_format,
    )
    assert result.usage.prompt_tokens > BUDGET
    assert json.loads(result.choices[0].message.content)["answer"] in ("yes", "no")


def test_stop_strings_that_hit_at_once_give_an_empty_answer(server, tokenizer):
    ids = long_ids(tokenizer, COMPACTED_TOKENS, seed=7)
    first = assert_valid_completion(completion(server, prompt=ids, max_tokens=1, temperature=0))
    first_text = first["choices"][0]["text"]
    assert first_text, "the greedy first token decodes to no text"
    body = assert_valid_completion(
        completion(server, prompt=ids, max_tokens=16, temperature=0, stop=[first_text, "\n", "."])
    )
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == ""


def test_more_stop_strings_than_allowed_are_refused_naming_stop(server):
    assert_clear_4xx(completion(server, prompt="Hello", max_tokens=4, stop=list("abcdefgh")), "stop")


# -- malformed bodies -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "word"),
    [
        (b"{not json", "json"),
        (b"[]", "object"),
        ({"prompt": "Hello", "max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": {"nested": True}, "max_tokens": 4}, "prompt"),
    ],
)
def test_malformed_body_is_refused_naming_the_problem(server, body, word):
    if isinstance(body, dict):
        body = {"model": server.served_model_name, **body}
    response = post(server, "/completions", body)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert word.lower() in response.text.lower(), response.text[:500]


def test_unknown_model_is_refused_naming_it(server):
    response = post(server, "/completions", {"model": "no-such-model", "prompt": "Hi", "max_tokens": 2})
    assert_clear_4xx(response, "no-such-model")


# -- clients that go away ---------------------------------------------------------------------------------
def test_streams_closed_at_random_moments_release_their_blocks(server, tokenizer):
    rng = random.Random(13)
    client = client_of(server)
    for index in range(6):
        stream = client.completions.create(
            model=server.served_model_name, prompt=long_ids(tokenizer, 300 + 60 * index, seed=20 + index),
            max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True},
        )
        stop_after = rng.randrange(0, 12)
        for received, _chunk in enumerate(stream):
            if received >= stop_after:
                break
        stream.close()
    assert wait_for_usage_zero(server) == 0


def test_after_all_of_it_the_server_is_healthy_answers_and_holds_no_block(server, tokenizer):
    assert httpx.get(server.root_url + "/health", timeout=30).status_code == 200
    assert wait_for_usage_zero(server) == 0, server.metric_value(USAGE)
    body = assert_valid_completion(
        completion(server, prompt=long_ids(tokenizer, COMPACTED_TOKENS, seed=8), max_tokens=8, temperature=0)
    )
    assert body["usage"]["completion_tokens"] == 8 or body["choices"][0]["finish_reason"] == "stop"
    assert wait_for_usage_zero(server) == 0
    assert wait_for_worker_state_empty(server) == 0
    assert server.is_running()
