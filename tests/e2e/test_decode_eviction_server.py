"""The decode-time cap inside a real ``vllm serve`` with the bundled model (issue 12).

One server: SnapKV after prefill (256 per KV head) and RoCo while decoding, capped at 256 per KV head and
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
CAP = 256
INTERVAL = BLOCK_SIZE  # the default: one block
# A head holds at most CAP + max(interval, 2 blocks) entries (right before a re-score, the step's token
# included): CAP + interval in steady state, CAP + 2 blocks when a prompt kept whole is first cut.
SLACK = max(INTERVAL, 2 * BLOCK_SIZE)
OUTPUT_TOKENS = 2100
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
    "256",
    "--kv-decode-eviction",
    "roco",
    "--kv-decode-budget",
    str(CAP),
)
USAGE = "vllm:kv_cache_usage_perc"
SAVED = "vllm_kvevict_kv_cache_saved_perc"
GENERATED = "vllm:generation_tokens_total"
RUNNING = "vllm:num_requests_running"
START_OTHERS_AT = 400  # the capped request's output tokens when the other two are sent
LATE_AFTER = 1800
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
    extra = {"ignore_eos": True, **({"vllm_xargs": xargs} if xargs else {})}
    result = client_of(server).completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    out[key] = result.usage.completion_tokens


def long_prompt(num_chars: int) -> str:
    """About num_chars / 4 tokens of a caravan log, then a question (its prompt is compacted)."""
    places = ["dunes", "river", "pass"]
    log = " ".join(f"On day {d}, the caravan crossed the {places[d % 3]} at dawn." for d in range(600))
    return log[:num_chars] + "\nQuestion: where was the caravan on day 7? Answer:"


class MetricsSampler(threading.Thread):
    """Scrapes ``/metrics`` every ``interval_s`` on its own thread, so what it records follows the server's
    progress (its generation counter), not how fast the test reads its stream."""

    def __init__(self, server: VLLMServer, others: dict[str, int], interval_s: float = 0.2):
        super().__init__(daemon=True)
        self.server, self.others, self.interval_s = server, others, interval_s
        self.generated_before = gauge(server, GENERATED)
        self.samples: list[Sample] = []
        self.reached_start_of_others = threading.Event()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            others_done = len(self.others) == 2  # read before the scrape: done then means done at the scrape
            values = {name: 0.0 for name in (GENERATED, RUNNING, USAGE, SAVED)}
            for name, value in self._scrape():
                values[name] += value
            sample = Sample(
                generated=values[GENERATED] - self.generated_before,
                running=values[RUNNING],
                usage=values[USAGE],
                saved=values[SAVED],
                others_done=others_done,
            )
            self.samples.append(sample)
            if sample.generated >= START_OTHERS_AT:
                self.reached_start_of_others.set()
            time.sleep(self.interval_s)

    def _scrape(self) -> list[tuple[str, float]]:
        from prometheus_client.parser import text_string_to_metric_families

        wanted = {GENERATED, RUNNING, USAGE, SAVED}
        return [
            (sample.name, float(sample.value))
            for family in text_string_to_metric_families(self.server.metrics_text())
            for sample in family.samples
            if sample.name in wanted
        ]


@dataclass(frozen=True)
class Sample:
    generated: float  # output tokens of every request since the test began (the server's counter)
    running: float
    usage: float
    saved: float
    others_done: bool


def test_a_capped_request_stays_within_its_cap_for_2000_tokens_beside_uncapped_and_prefilling_ones(
    server, dump_dir
):
    """A short prompt generates 2100 tokens (ignore_eos). While it decodes, an uncapped request
    (``vllm_xargs kv_eviction=none``) decodes and a long prompt is prefilled and compacted in the same
    steps. Every head of every layer stays within CAP + SLACK; the freed blocks show on the gauges while
    it runs, and every block comes back after."""
    freed_before = counter(server, DECODE_BLOCKS_FREED)
    before = set(dump_dir.glob("*.decode.pt"))
    others: dict[str, int] = {}
    threads = [
        threading.Thread(
            target=complete, args=(server, "Count slowly:", 300, {"kv_eviction": "none"}, others, "uncapped")
        ),
        threading.Thread(target=complete, args=(server, long_prompt(5000), 8, None, others, "prefill")),
    ]
    sampler = MetricsSampler(server, others)
    sampler.start()

    def start_others_mid_decode() -> None:
        sampler.reached_start_of_others.wait()
        for thread in threads:
            thread.start()

    starter = threading.Thread(target=start_others_mid_decode, daemon=True)
    starter.start()
    stream = client_of(server).completions.create(
        model=server.served_model_name,
        prompt="Write a very long story about a lighthouse keeper.",
        max_tokens=OUTPUT_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    # A streamed chunk may carry several tokens when the API server falls behind; the last one has the usage.
    generated = [chunk.usage.completion_tokens for chunk in stream if chunk.usage is not None]
    starter.join(timeout=60)
    for thread in threads:
        thread.join()
    sampler.stopped.set()
    sampler.join()
    assert generated == [OUTPUT_TOKENS]
    assert others == {"uncapped": 300, "prefill": 8}

    # Late in its decode (>= 1800 of its tokens: every token of the others counted too) and alone on the
    # server, the capped request's usage is a fraction of what it would hold uncapped (usage + saved).
    late = [
        s for s in sampler.samples if s.others_done and s.running == 1 and s.generated >= LATE_AFTER + 300 + 8
    ]
    assert late and all(s.usage <= 0.25 * (s.usage + s.saved) for s in late), sampler.samples[-40:]
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
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for index, _chunk in enumerate(stream):
        if index == 600:  # well past the first re-score (t1 = 2 x 32 + 256 - prompt)
            break
    stream.close()
    assert wait_for_zero(server, USAGE) == 0
    assert wait_for_zero(server, "vllm_kvevict_worker_requests") == 0


def test_the_start_up_line_states_the_decode_cap(server):
    log = Path(server.log_path).read_text()
    bound = cdiv(CAP + SLACK, BLOCK_SIZE) + 1
    assert f"re-scored every {INTERVAL} tokens down to {CAP} (at most {CAP + SLACK} entries per head)" in log
    assert f"holds <= {bound} blocks" in log
