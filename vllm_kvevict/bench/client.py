"""Sends the workload to one server, all at once (up to a concurrency cap), streaming, and times it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from openai import AsyncOpenAI, Timeout

from vllm_kvevict.bench.workload import Workload

#: The whole workload is sent at once on purpose, so a request may wait in the server's queue for as long as
#: the run takes before its first byte (over an hour for 64 4k-token prompts on two CPU cores): no read
#: limit, only a connect one. The server is one the bench started and watches.
CLIENT_TIMEOUT = Timeout(None, connect=60.0)


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float
    latency_s: float
    output_tokens: int
    prompt_tokens: int = 0

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first, in ms."""
        return 1000 * (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class RunTiming:
    requests: list[RequestTiming]
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return sum(request.output_tokens for request in self.requests)


async def _one_request(client: AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> RequestTiming:
    start = time.perf_counter()
    first: float | None = None
    output_tokens = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": max_tokens},
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.usage is not None:
            output_tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return RequestTiming(
        ttft_s=(first or end) - start,
        latency_s=end - start,
        output_tokens=output_tokens,
        prompt_tokens=len(prompt),
    )


async def _run(base_url: str, model: str, workload: Workload, concurrency: int) -> RunTiming:
    limit = asyncio.Semaphore(concurrency)
    client = AsyncOpenAI(base_url=base_url, api_key="EMPTY", timeout=CLIENT_TIMEOUT, max_retries=0)
    async with client:

        async def limited(prompt: list[int]) -> RequestTiming:
            async with limit:
                return await _one_request(client, model, prompt, workload.output_tokens)

        start = time.perf_counter()
        timings = await asyncio.gather(*(limited(prompt) for prompt in workload.prompts))
        return RunTiming(requests=list(timings), wall_s=time.perf_counter() - start)


def run_workload(base_url: str, model: str, workload: Workload, concurrency: int) -> RunTiming:
    """``base_url`` ends in ``/v1``."""
    return asyncio.run(_run(base_url, model, workload, concurrency))
