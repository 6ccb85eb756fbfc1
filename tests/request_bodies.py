"""How the e2e and reliability tests talk to a server: the OpenAI client and the ``extra_body`` they send."""

from __future__ import annotations

from typing import Any


def client_of(server: Any, timeout_s: float = 300):
    """The ``openai`` client of ``server`` (a ``VLLMServer``), with no retries: a failed request must show."""
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="unused", timeout=timeout_s, max_retries=0)


def ignore_eos_body(xargs: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    """``ignore_eos`` (the request generates exactly ``max_tokens``), the given vLLM fields (e.g.
    ``return_token_ids=True``) and, when given, the per-request eviction settings as ``vllm_xargs``."""
    return {"ignore_eos": True, **fields, **({"vllm_xargs": xargs} if xargs else {})}
