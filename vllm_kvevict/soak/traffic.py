"""Mixed traffic for ``vllm-kvevict soak``: short, long, streaming, aborted and invalid requests.

``concurrency`` clients loop until the deadline, each picking a kind at random (seeded) and recording how
the server answered. Requests go through httpx to the OpenAI completions endpoint, so invalid bodies reach
the server as sent. Every answer is classified once: ``served`` (a complete valid answer), ``aborted`` (a
stream we closed on purpose), ``4xx`` (expected for invalid kinds), ``5xx`` and ``transport`` errors.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

#: kind -> relative frequency.
KIND_WEIGHTS: dict[str, int] = {"short": 3, "long": 3, "streaming": 3, "aborted": 2, "invalid": 1}
OUTCOMES = ("served", "aborted", "4xx", "5xx", "transport")


@dataclass(frozen=True)
class Prompts:
    """Token-id prompts: ``long`` ones beyond the eviction budget (compacted), ``short`` ones within it."""

    long: list[list[int]]
    short: list[list[int]]
    max_model_len: int
    vocab_size: int


@dataclass
class TrafficCounts:
    """Outcome counts per request kind, plus what went wrong (first examples) for the report."""

    by_kind: dict[str, Counter[str]] = field(
        default_factory=lambda: {kind: Counter() for kind in KIND_WEIGHTS}
    )
    generated_tokens: int = 0
    problems: list[str] = field(default_factory=list)

    def record(self, kind: str, outcome: str, problem: str | None = None) -> None:
        self.by_kind[kind][outcome] += 1
        if problem is not None and len(self.problems) < 20:
            self.problems.append(f"{kind}: {problem}")

    def total(self, outcome: str) -> int:
        return sum(counts[outcome] for counts in self.by_kind.values())

    @property
    def unexpected_4xx(self) -> int:
        """4xx answers to requests that were valid."""
        return sum(counts["4xx"] for kind, counts in self.by_kind.items() if kind != "invalid")


def invalid_bodies(model: str, prompts: Prompts) -> list[bytes]:
    """Requests a careless client sends; each must be answered with a 4xx."""
    bodies: list[object] = [
        {"model": model, "prompt": [1, 2, prompts.vocab_size + 5], "max_tokens": 4},
        {"model": model, "prompt": prompts.long[0] * (prompts.max_model_len // len(prompts.long[0]) + 1),
         "max_tokens": 4},
        {"model": model, "prompt": "Hello", "max_tokens": -3},
        {"model": model, "prompt": "Hello", "max_tokens": 10**9},
        {"model": model, "prompt": "", "max_tokens": 4},
        {"model": model, "prompt": "Hello", "temperature": -1},
        {"model": "no-such-model", "prompt": "Hello", "max_tokens": 4},
    ]
    return [json.dumps(body).encode() for body in bodies] + [b"{not json", b"[]"]


class TrafficRun:
    """One soak's traffic against ``base_url`` (``.../v1``) until ``deadline`` (``time.monotonic()``)."""

    def __init__(
        self, base_url: str, model: str, prompts: Prompts, seed: int, request_timeout_s: float
    ) -> None:
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self.prompts = prompts
        self.invalid = invalid_bodies(model, prompts)
        self.rng = random.Random(seed)
        self.timeout = httpx.Timeout(request_timeout_s, connect=30.0)
        self.counts = TrafficCounts()

    def run(self, concurrency: int, deadline: float) -> TrafficCounts:
        asyncio.run(self._run(concurrency, deadline))
        return self.counts

    async def _run(self, concurrency: int, deadline: float) -> None:
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as client:
            await asyncio.gather(*(self._client_loop(client, deadline, i) for i in range(concurrency)))

    async def _client_loop(self, client: httpx.AsyncClient, deadline: float, index: int) -> None:
        kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
        # Client i starts with kind i, so that with >= len(kinds) clients even a short soak sends every kind.
        kind = kinds[index % len(kinds)]
        while time.monotonic() < deadline:
            try:
                await getattr(self, f"_{kind}")(client)
            except httpx.HTTPError as error:
                self.counts.record(kind, "transport", f"{type(error).__name__}: {error}")
            kind = self.rng.choices(kinds, weights)[0]

    # -- one method per kind ------------------------------------------------------------------------------
    def _body(self, prompt: list[int], max_tokens: int, **extra: object) -> dict[str, object]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}

    async def _short(self, client: httpx.AsyncClient) -> None:
        body = self._body(self.rng.choice(self.prompts.short), self.rng.randint(1, 16))
        await self._complete(client, "short", body)

    async def _long(self, client: httpx.AsyncClient) -> None:
        body = self._body(self.rng.choice(self.prompts.long), self.rng.randint(16, 96), ignore_eos=True)
        await self._complete(client, "long", body)

    async def _streaming(self, client: httpx.AsyncClient) -> None:
        await self._stream(client, "streaming", stop_after=None)

    async def _aborted(self, client: httpx.AsyncClient) -> None:
        await self._stream(client, "aborted", stop_after=self.rng.randint(0, 24))

    async def _invalid(self, client: httpx.AsyncClient) -> None:
        content = self.rng.choice(self.invalid)
        response = await client.post(self.url, content=content, headers={"Content-Type": "application/json"})
        if 400 <= response.status_code < 500:
            self.counts.record("invalid", "4xx")
        else:
            self._record_status("invalid", response.status_code, response.text, content)

    # -- shared --------------------------------------------------------------------------------------------
    async def _complete(self, client: httpx.AsyncClient, kind: str, body: dict[str, object]) -> None:
        response = await client.post(self.url, json=body)
        if response.status_code != 200:
            self._record_status(kind, response.status_code, response.text, body)
            return
        answer = response.json()
        if not answer.get("choices"):
            self.counts.record(kind, "5xx", f"200 without choices: {response.text[:200]}")
            return
        self.counts.generated_tokens += int(answer["usage"]["completion_tokens"])
        self.counts.record(kind, "served")

    async def _stream(self, client: httpx.AsyncClient, kind: str, stop_after: int | None) -> None:
        body = self._body(self.rng.choice(self.prompts.long), self.rng.randint(32, 128), stream=True,
                          ignore_eos=True)
        async with client.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                self._record_status(kind, response.status_code, (await response.aread()).decode(), body)
                return
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.counts.generated_tokens += chunks
                    self.counts.record(kind, "served")
                    return
                if '"error"' in line:
                    self.counts.record(kind, "5xx", f"error event in stream: {line[:200]}")
                    return
                chunks += 1
                if stop_after is not None and chunks > stop_after:
                    break  # leaving the context closes the connection mid-stream: the server must abort
        if stop_after is not None:
            self.counts.record(kind, "aborted")
        else:
            self.counts.record(kind, "transport", "stream ended without [DONE]")

    def _record_status(self, kind: str, status: int, text: str, body: object) -> None:
        outcome = "4xx" if 400 <= status < 500 else "5xx"
        shown = (body if isinstance(body, bytes) else json.dumps(body).encode())[:120]
        self.counts.record(kind, outcome, f"HTTP {status} for {shown!r}: {text[:200]}")
