"""Stream a chat answer from a vllm-kvevict server with the openai client.

    python examples/streaming_chat.py [--base-url http://127.0.0.1:8000/v1] [--max-tokens 32]

The base URL comes from --base-url, else OPENAI_BASE_URL, else http://127.0.0.1:8000/v1; the model is the
server's first (``/v1/models``). Eviction needs nothing in the request: the server's --kv-eviction applies.
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three colours of the rainbow."}],
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
    )
    pieces, finish_reason = 0, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            pieces += 1
            print(choice.delta.content, end="", flush=True)
        finish_reason = choice.finish_reason or finish_reason
    print(f"\n[{pieces} streamed pieces, finish_reason={finish_reason}]")


if __name__ == "__main__":
    main()
