"""Per-request eviction settings through ``extra_body={"vllm_xargs": {...}}`` (docs/usage.md).

    python examples/per_request_settings.py [--base-url http://127.0.0.1:8000/v1]

Three long chat prompts: one with the server's setting, one with another method and budget (``kv_eviction``,
``kv_budget``), one kept whole (``kv_eviction: "none"``); then a bad value, which the server answers with
HTTP 400 naming the value and the valid ones. At the end it prints, from ``/metrics``, how many requests each
method compacted or left whole (the label is the request's own method). Each prompt is its own document:
a request that starts from another's cached prompt (vLLM's prefix caching) compacts only its own part, and
keeps that whole when compacting it would free little (``min_freed_share``, docs/usage.md).
"""

from __future__ import annotations

import argparse
import os
import urllib.request

from openai import BadRequestError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

QUESTION = "\nHow many boxes are on shelf 12? Answer with the number."
SETTINGS = {
    "server's setting": None,
    "snapkv at 10 %": {"kv_eviction": "snapkv", "kv_budget": 0.1},
    "kept whole": {"kv_eviction": "none"},
}


def document(room: int) -> str:
    """~450 tokens, longer than every budget below; ``room`` makes each prompt differ from its start."""
    return f"Inventory of room {room}. " + " ".join(
        f"Shelf {n} holds {(n * 7 + room) % 50} boxes of item {(n * 13 + room) % 97}." for n in range(28)
    )


def request_counts(metrics_url: str) -> dict[str, dict[str, float]]:
    """{"compacted"|"skipped": {method: requests}} from the server's /metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counts: dict[str, dict[str, float]] = {"compacted": {}, "skipped": {}}
    for family in text_string_to_metric_families(text):
        for kind in counts:
            if family.name == f"vllm_kvevict_requests_{kind}":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        counts[kind][sample.labels["method"]] = sample.value
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    model = client.models.list().data[0].id
    for room, (label, xargs) in enumerate(SETTINGS.items()):
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": document(room) + QUESTION}],
            max_tokens=8,
            temperature=0,
            extra_body={"vllm_xargs": xargs} if xargs else None,
        )
        print(f"{label}: {answer.choices[0].message.content!r} ({answer.usage.prompt_tokens} prompt tokens)")
    try:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=8,
            extra_body={"vllm_xargs": {"kv_budget": "lots"}},
        )
    except BadRequestError as exc:
        print(f"refused with HTTP {exc.status_code}: {exc.body['message'] if exc.body else exc}")
    metrics_url = args.base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    for kind, by_method in request_counts(metrics_url).items():
        print(f"requests {kind} so far, by method: {by_method}")


if __name__ == "__main__":
    main()
