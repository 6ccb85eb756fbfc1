"""A document compressed once and asked several questions (``"kv_context": "keep"``, docs/usage.md).

    python examples/kept_context.py [--base-url http://127.0.0.1:8000/v1] [--method ada-kvzap]

A kept context needs a method whose heads keep whole blocks with one budget per layer: the uniform top-k
methods (snapkv, knorm, keydiff, expected-attention, streamingllm, kvzap) and the Ada-KV ones. The served
default ada-snapkv keeps one as ada-kvzap, the learned question-agnostic scorer, where one ships for the
model. PyramidKV, whose layers keep different budgets, cannot: asking it is answered with HTTP 400 naming
the methods that can, shown first. Then the document alone is sent once (it becomes the kept context), and
two questions that start with it read it instead of computing the document again. Prompts go as token ids
(from the server's ``/tokenize``): a reader's prompt must start with the creator's tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.request

from openai import BadRequestError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

DOCUMENT = "Stock list. " + " ".join(
    f"Shelf {n} holds {n * 3 % 40} boxes of item {n * 11 % 89}." for n in range(28)
)
QUESTIONS = (
    "\nQ: How many boxes are on shelf 12?\nA: Shelf 12 holds",
    "\nQ: Which item is on shelf 20?\nA: Shelf 20 holds",
)


def post_json(url: str, payload: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(payload).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    return json.load(urllib.request.urlopen(request, timeout=60))


def kept_contexts(metrics_url: str) -> dict[str, float]:
    """{"kept": n, "read": n} of ``vllm_kvevict_kept_contexts_total`` on the server's /metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counts = {"kept": 0.0, "read": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == "vllm_kvevict_kept_contexts":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["event"]] = sample.value
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--method", default="", help="a method that keeps contexts (default: the server's)")
    parser.add_argument("--budget", type=float, default=0.25)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    model = client.models.list().data[0].id
    root = args.base_url.rstrip("/").removesuffix("/v1")

    def token_ids(text: str) -> list[int]:
        return post_json(f"{root}/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})[
            "tokens"
        ]

    document = token_ids(DOCUMENT)
    try:
        pyramid = {"kv_eviction": "pyramidkv", "kv_context": "keep"}
        client.completions.create(
            model=model, prompt=document, max_tokens=1, extra_body={"vllm_xargs": pyramid}
        )
        print("pyramidkv kept the context")
    except BadRequestError as exc:
        print(f"pyramidkv cannot keep a context, HTTP {exc.status_code}: {exc.body['message']}")

    settings = {"kv_budget": args.budget, "kv_context": "keep"}
    if args.method:
        settings["kv_eviction"] = args.method
    keep = {"vllm_xargs": settings}
    before = kept_contexts(f"{root}/metrics")
    client.completions.create(model=model, prompt=document, max_tokens=1, extra_body=keep)  # the creator
    for question in QUESTIONS:
        answer = client.completions.create(
            model=model, prompt=document + token_ids(question), max_tokens=8, temperature=0, extra_body=keep
        )
        print(f"{' '.join(question.split())} {answer.choices[0].text!r}")
    after = kept_contexts(f"{root}/metrics")
    print(
        f"{len(document)}-token document, {args.method or 'the server method'} at {args.budget}: "
        f"contexts kept {after['kept'] - before['kept']:g}, read {after['read'] - before['read']:g}"
    )


if __name__ == "__main__":
    main()
