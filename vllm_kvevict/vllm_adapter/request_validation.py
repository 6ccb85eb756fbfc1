"""API-server validation of the per-request ``vllm_xargs`` keys, through two of vLLM's extension points
(no vLLM function is wrapped; ``engine_setup.enable_request_validation`` registers both when eviction is on):

- ``--middleware`` (``VllmXargsMiddleware``, a plain ASGI middleware): a JSON POST body whose ``vllm_xargs``
  holds a bad ``kv_eviction``/``kv_budget`` gets HTTP 400 before vLLM's handler runs. Needed for streaming:
  by the time vLLM validates a streamed request it has already answered 200, and the error would arrive
  inside the event stream.
- ``--logits-processors`` (``EvictionArgsValidator``): vLLM 0.32.0's ``InputProcessor._validate_params``
  calls ``validate_params`` for every request that enters the engine from any endpoint; a
  ``VLLMValidationError`` becomes HTTP 400 for non-streamed requests. On the worker it is a no-op logits
  processor (argmax invariant, logits returned unchanged).

The server's setting reaches both (no config is passed to them) through an environment variable set by the
``vllm serve`` flag handling before any API server process starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from vllm_kvevict.settings.additional_config import from_wire, to_wire
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.parsers import EvictionConfigError
from vllm_kvevict.settings.request_override import parse_override

#: JSON of the server's EvictionConfig, read by the API server processes.
SERVER_CONFIG_ENV = "KVEVICT_SERVER_EVICTION"
#: what ``--logits-processors`` gets (vLLM's "<module>:<class>" form).
VALIDATOR_FQCN = f"{__name__}:EvictionArgsValidator"
#: what ``--middleware`` gets (vLLM's "<module>.<object>" form).
MIDDLEWARE_PATH = f"{__name__}.VllmXargsMiddleware"


def publish_server_config(config: EvictionConfig) -> None:
    """Make the server's setting visible to this process and the API server processes it spawns."""
    os.environ[SERVER_CONFIG_ENV] = json.dumps(to_wire(config), sort_keys=True)


def xargs_problem(extra_args: Any) -> str | None:
    """Why a request's ``vllm_xargs`` cannot be served (naming the value and the valid ones), or None."""
    text = os.environ.get(SERVER_CONFIG_ENV)
    if not text or not isinstance(extra_args, dict):
        return None  # no eviction on this server (the keys are not read anywhere), or vLLM rejects the type
    try:
        parse_override(extra_args, from_wire(text))  # validated once per process (from_wire)
    except EvictionConfigError as exc:
        return str(exc)
    return None


def validate_request_args(sampling_params: SamplingParams) -> None:
    """Raise VLLMValidationError (HTTP 400) naming the bad ``vllm_xargs`` value and the valid ones."""
    problem = xargs_problem(sampling_params.extra_args)
    if problem is not None:
        raise VLLMValidationError(problem, parameter="vllm_xargs")


class EvictionArgsValidator(LogitsProcessor):
    """Validates ``kv_eviction``/``kv_budget`` per request; changes no logits."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        validate_request_args(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass


class VllmXargsMiddleware:
    """ASGI middleware: HTTP 400 for a JSON POST whose ``vllm_xargs`` the server cannot serve, before vLLM's
    handler runs (streamed or not); every other request passes through untouched, its body replayed."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the whole body
                await self.app(scope, _replay(message, receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = _body_problem(body)
        if problem is not None:
            await _send_400(send, problem)
            return
        whole_body = {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, _replay(whole_body, receive), send)


def _is_json(scope: dict) -> bool:
    content_type = dict(scope.get("headers") or []).get(b"content-type", b"")
    return content_type.split(b";")[0].strip().lower() == b"application/json"


def _body_problem(body: bytes) -> str | None:
    if b"vllm_xargs" not in body:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None  # vLLM answers malformed JSON itself
    return xargs_problem(payload.get("vllm_xargs")) if isinstance(payload, dict) else None


def _replay(first: dict, receive: Callable) -> Callable[[], Awaitable[dict]]:
    """A ``receive`` that returns ``first`` once, then the connection's own messages (disconnects)."""
    pending = [first]

    async def replay() -> dict:
        return pending.pop() if pending else await receive()

    return replay


async def _send_400(send: Callable, message: str) -> None:
    """vLLM's own error body (``ErrorResponse``), as its handlers send it."""
    body = json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": "vllm_xargs", "code": 400}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})
