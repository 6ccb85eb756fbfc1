"""The decode-time cap inside a real ``vllm serve`` with the bundled model (issue 12).

One server: SnapKV after prefill (128 per KV head) and RoCo while decoding, capped at 128 per KV head and
re-scored every block (32 tokens). It saves each capped request's per-head lengths right before every
re-score (``KVEVICT_DEBUG_DUMP_DIR``): those are the largest each head ever holds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vllm_kvevict.cli.server_process import VLLMServer
from vllm_kvevict.layout.accounting import cdiv
from vllm_kvevict.vllm_adapter.eviction_step import DEBUG_DUMP_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BLOCK_SIZE = 32
CAP = 128
INTERVAL = BLOCK_SIZE  # the default: one block
# A head holds at most CAP + max(interval, 2 blocks) entries (right before a re-score, the step's token
# included): CAP + interval in steady state, CAP + 2 blocks when a prompt kept whole is first cut.
SLACK = max(INTERVAL, 2 * BLOCK_SIZE)
OUTPUT_TOKENS = 800
CAPPED_PROMPT = "Write a very long story about a lighthouse keeper."
SERVER_ARGS = (
    "--max-model-len",
    "4096",
    "--max-num-batched-tokens",
    "4096",
    "--max-num-seqs",
    "8",
    "--block-size",
    str(BLOCK_SIZE),
    "--kv-eviction",
    "snapkv",
    "--kv-budget",
    str(CAP),
    "--kv-decode-eviction",
    "roco",
    "--kv-decode-budget",
    str(CAP),
)
USAGE = "vllm:kv_cache_usage_perc"
SAVED = "vllm_kvevict_kv_cache_saved_perc"
GENERATED = "vllm:generation_tokens_total"
RUNNING = "vllm:num_requests_running"
START_OTHERS_AT = 100  # the capped request's streamed tokens when the other two are sent
ALONE_AFTER = 500  # the capped request's streamed tokens from which its usage is checked alone on the server
SAMPLE_EVERY = 10  # streamed tokens between two reads of /metrics
UNCAPPED_TOKENS, PREFILL_TOKENS = 200, 8  # what the uncapped and the prefilled request generate
OTHERS_TOKENS = UNCAPPED_TOKENS + PREFILL_TOKENS
# The most blocks a capped request holds (the start-up line's "holds <= ..."), whatever its length.
HELD_BLOCKS_BOUND = cdiv(CAP + SLACK, BLOCK_SIZE) + 1
DECODE_BLOCKS_FREED = "vllm_kvevict_decode_blocks_freed_total"


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("decode")


@pytest.fixture(scope="module")
def server(model_dir, dump_dir):
    env = {DEBUG_DUMP_ENV: str(dump_dir)}
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, kv_cache_space_gib=1, env=env) as launched:
        yield launched


def client_of(server: VLLMServer):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="unused", timeout=1200, max_retries=0)


def counter(server: VLLMServer, name: str) -> float:
    return sum(value for labels, value in server.metric_samples(name) if labels.get("method") == "roco")


def gauge(server: VLLMServer, name: str) -> float:
    """A gauge's value, 0 before it is first set (the saved-blocks gauge appears at the first free)."""
    return sum(value for _, value in server.metric_samples(name))


def wait_for_zero(server: VLLMServer, name: str, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    value = server.metric_value(name)
    while value != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        value = server.metric_value(name)
    return value


def complete(server: VLLMServer, prompt: str, max_tokens: int, xargs: dict | None, out: dict, key: str):
    """Send one completion and put its usage in ``out[key]``."""
    extra = {"ignore_eos": True, **({"vllm_xargs": xargs} if xargs else {})}
    result = client_of(server).completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    out[key] = result.usage


def long_prompt(num_chars: int) -> str:
    """About num_chars / 4 tokens of a caravan log, then a question (its prompt is compacted)."""
    places = ["dunes", "river", "pass"]
    log = " ".join(f"On day {d}, the caravan crossed the {places[d % 3]} at dawn." for d in range(600))
    return log[:num_chars] + "\nQuestion: where was the caravan on day 7? Answer:"


@dataclass(frozen=True)
class Sample:
    generated: float  # output tokens of every request since the test began (the server's counter)
    running: float
    usage: float
    saved: float
    others_done: bool


def scrape(server: VLLMServer, generated_before: float, others_done: bool) -> Sample:
    """One ``/metrics`` read; ``others_done`` is read by the caller before it, so done means done then."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {name: 0.0 for name in (GENERATED, RUNNING, USAGE, SAVED)}
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += float(sample.value)
    return Sample(
        generated=values[GENERATED] - generated_before,
        running=values[RUNNING],
        usage=values[USAGE],
        saved=values[SAVED],
        others_done=others_done,
    )


def capped_held_fraction_bound(prompt_tokens: int, capped_generated: float) -> float:
    """The largest usage / (usage + saved) of the capped request alone: the blocks the start-up line promises
    (``holds <= ...``) over the blocks its prompt and outputs would take uncapped."""
    return HELD_BLOCKS_BOUND / cdiv(prompt_tokens + int(capped_generated), BLOCK_SIZE)


def test_a_capped_request_stays_within_its_cap_for_800_tokens_beside_uncapped_and_prefilling_ones(
    server, dump_dir
):
    """A short prompt generates 800 tokens (ignore_eos), streamed. While it decodes, an uncapped request
    (``vllm_xargs kv_eviction=none``) decodes and a long prompt is prefilled and compacted in the same
    steps. Every head of every layer stays within CAP + SLACK; the freed blocks show on the gauges while
    it runs, and every block comes back after.

    The main thread reads the capped request's stream and scrapes ``/metrics`` every SAMPLE_EVERY tokens, so
    the samples are placed by the capped request's own progress, not by wall-clock time: the other two
    requests share its steps and are done long before ALONE_AFTER on any machine."""
    freed_before = counter(server, DECODE_BLOCKS_FREED)
    generated_before = gauge(server, GENERATED)
    before = set(dump_dir.glob("*.decode.pt"))
    results: dict[str, object] = {}
    others = [
        threading.Thread(
            target=complete,
            args=(server, "Count slowly:", UNCAPPED_TOKENS, {"kv_eviction": "none"}, results, "uncapped"),
        ),
        threading.Thread(
            target=complete, args=(server, long_prompt(5000), PREFILL_TOKENS, None, results, "prefill")
        ),
    ]
    stream = client_of(server).completions.create(
        model=server.served_model_name, prompt=CAPPED_PROMPT, max_tokens=OUTPUT_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    samples: list[Sample] = []
    streamed, next_sample_at = 0, ALONE_AFTER
    for chunk in stream:
        if chunk.usage is not None:
            results["capped"] = chunk.usage
        if not chunk.choices:
            continue
        # A chunk carries every token generated since the last one read (one, unless the reader lagged).
        streamed += len(chunk.choices[0].token_ids)
        if streamed >= START_OTHERS_AT and others[0].ident is None:
            for thread in others:
                thread.start()
        if streamed >= next_sample_at:
            next_sample_at += SAMPLE_EVERY
            others_done = not any(thread.is_alive() for thread in others)
            samples.append(scrape(server, generated_before, others_done))
    for thread in others:
        thread.join()
    assert results["capped"].completion_tokens == streamed == OUTPUT_TOKENS
    assert results["uncapped"].completion_tokens == UNCAPPED_TOKENS
    assert results["prefill"].completion_tokens == PREFILL_TOKENS

    # Alone on the server once the others are done (every token of theirs counted), from ALONE_AFTER of its
    # own tokens on, the capped request's usage is within what its cap allows of what it would hold uncapped.
    prompt_tokens = results["capped"].prompt_tokens
    alone = [s for s in samples if s.others_done and s.running == 1]
    assert len(alone) >= (OUTPUT_TOKENS - ALONE_AFTER) // SAMPLE_EVERY // 2, samples
    for s in alone:
        bound = capped_held_fraction_bound(prompt_tokens, s.generated - OTHERS_TOKENS)
        assert s.usage <= bound * (s.usage + s.saved), (s, bound)
    assert counter(server, DECODE_BLOCKS_FREED) - freed_before >= (OUTPUT_TOKENS - CAP) // BLOCK_SIZE - 2

    # Every head of every layer, right before each re-score (its largest size), within CAP + SLACK.
    dumps = [torch.load(path) for path in set(dump_dir.glob("*.decode.pt")) - before]
    capped = [d for d in dumps if len(d["rescored_at"]) > 10]
    assert len(capped) == 1, [len(d["rescored_at"]) for d in dumps]
    record = capped[0]
    assert record["decode_cap"] == CAP and record["decode_interval"] == INTERVAL
    assert len(record["rescored_at"]) >= (OUTPUT_TOKENS - CAP - SLACK) // INTERVAL
    peaks = torch.tensor(record["lengths_before"])  # [re-scores, layers, heads]
    assert peaks.shape[1:] == (30, 3)
    assert int(peaks.max()) <= CAP + SLACK
    assert int(peaks[1:].min()) >= CAP  # the cap is what each head keeps, not less

    assert wait_for_zero(server, USAGE) == 0
    assert wait_for_zero(server, "vllm_kvevict_worker_requests") == 0


def test_aborting_a_capped_request_mid_decode_returns_its_blocks(server):
    stream = client_of(server).completions.create(
        model=server.served_model_name,
        prompt="List the prime numbers:",
        max_tokens=800,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for index, _chunk in enumerate(stream):
        if index == 300:  # well past the first re-score (t1 = 2 x 32 + 128 - prompt)
            break
    stream.close()
    assert wait_for_zero(server, USAGE) == 0
    assert wait_for_zero(server, "vllm_kvevict_worker_requests") == 0


def test_the_start_up_line_states_the_decode_cap(server):
    log = Path(server.log_path).read_text()
    assert f"re-scored every {INTERVAL} tokens down to {CAP} (at most {CAP + SLACK} entries per head)" in log
    assert f"holds <= {HELD_BLOCKS_BOUND} blocks" in log
