"""Completions against a running server with the standard library only (the GPU host's fewest dependencies).

Token ids in, token ids and their log-probabilities out (``return_tokens_as_token_ids``), greedy.
"""

from __future__ import annotations

import json
import random
import urllib.request
from dataclasses import dataclass


@dataclass
class Completion:
    """tokens [T] greedy token ids; logprobs [T] their log-probabilities."""

    tokens: list[int]
    logprobs: list[float]


def complete(base_url: str, model: str, prompt: list[int], max_tokens: int, xargs: dict | None = None,
             timeout_s: float = 300.0) -> Completion:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
        "ignore_eos": True, "return_tokens_as_token_ids": True,
    }
    if xargs:
        body["vllm_xargs"] = xargs
    request = urllib.request.Request(f"{base_url}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        choice = json.loads(response.read())["choices"][0]
    logprobs = choice["logprobs"]
    tokens = [int(token.removeprefix("token_id:")) for token in logprobs["tokens"]]
    return Completion(tokens, [float(value) for value in logprobs["token_logprobs"]])


def random_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """``num_tokens`` token ids drawn uniformly from the vocabulary's first ``vocab_size`` - 1000 ids
    (clear of special tokens at the end): random weights make text and noise equally meaningful."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab_size - 1000) for _ in range(num_tokens)]
