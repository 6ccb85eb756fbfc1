"""Send samples to any OpenAI-compatible server (completions endpoint) concurrently; score the answers."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from openai import OpenAI
from tqdm import tqdm

from vllm_kvevict.evaluation.answer_match import score
from vllm_kvevict.evaluation.results import Result
from vllm_kvevict.evaluation.sample import Sample


def make_client(base_url: str, api_key: str = "EMPTY", timeout_s: float = 600.0) -> OpenAI:
    """An OpenAI client for ``base_url`` (e.g. ``http://127.0.0.1:8000/v1``)."""
    return OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=2)


def served_model(client: OpenAI) -> str:
    """The first model the server lists (``GET /v1/models``)."""
    models = [m.id for m in client.models.list()]
    if not models:
        raise RuntimeError("the server lists no models; pass --model")
    return models[0]


def answer_sample(client: OpenAI, model: str, sample: Sample, config: str) -> Result:
    """Greedy completion of one sample, scored; a failed request becomes an unscored result with its error."""
    start = time.perf_counter()
    output, served_tokens, error = "", None, None
    try:
        response = client.completions.create(
            model=model, prompt=sample.prompt, max_tokens=sample.max_new_tokens, temperature=0.0
        )
        output = response.choices[0].text
        served_tokens = response.usage.prompt_tokens if response.usage else None
    except Exception as exc:  # noqa: BLE001 - any transport/server error is recorded, never scored
        error = f"{type(exc).__name__}: {exc}"
    return Result(
        config=config,
        sample_id=sample.id,
        task=sample.task,
        target_tokens=sample.target_tokens,
        prompt_tokens=sample.prompt_tokens,
        served_prompt_tokens=served_tokens,
        output=output,
        answers=sample.answers,
        score=None if error else score(output, sample.answers, sample.metric),
        latency_s=time.perf_counter() - start,
        error=error,
    )


def run_samples(
    client: OpenAI,
    model: str,
    samples: Sequence[Sample],
    config: str,
    concurrency: int = 4,
    progress: bool = True,
) -> list[Result]:
    """Answer every sample with ``concurrency`` requests in flight; results in the order of ``samples``."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    results: dict[str, Result] = {}
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(answer_sample, client, model, s, config) for s in samples]
        bar = tqdm(total=len(futures), desc=config, unit="req", disable=not progress)
        for future in as_completed(futures):
            result = future.result()
            results[result.sample_id] = result
            bar.update(1)
        bar.close()
    return [results[s.id] for s in samples]
