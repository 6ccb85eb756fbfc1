"""The ``extra_body`` the e2e and reliability tests send with a completion."""

from __future__ import annotations

from typing import Any


def ignore_eos_body(xargs: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    """``ignore_eos`` (the request generates exactly ``max_tokens``), the given vLLM fields (e.g.
    ``return_token_ids=True``) and, when given, the per-request eviction settings as ``vllm_xargs``."""
    return {"ignore_eos": True, **fields, **({"vllm_xargs": xargs} if xargs else {})}
