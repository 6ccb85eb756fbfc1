"""Per-head eviction inside a real ``vllm serve``, through HTTP and the ``openai`` client (issue 5, item 5;
per-request settings through ``vllm_xargs``: issue 14).

Two servers for the module, started once with the same settings except eviction: vanilla vLLM, and
``--kv-eviction ada-snapkv --kv-budget 512`` (ragged per-head budgets, the headline method), which saves
each compacted request's kept counts (``KVEVICT_DEBUG_DUMP_DIR``).
"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from greedy_answers import Greedy, assert_same_or_parting_at_a_near_tie
from request_bodies import client_of as openai_client

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.layout.accounting import plan_request
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.server_process import VLLMServer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BUDGET = 512
MAX_MODEL_LEN = 8192
# Both servers: whole prompts in one step (what eviction needs), so vanilla runs the very same schedule.
COMMON_ARGS = (
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-batched-tokens", str(MAX_MODEL_LEN),
    "--no-enable-prefix-caching",
    "--no-enable-chunked-prefill",
    "--max-num-seqs", "16",
)
EVICTION_ARGS = ("--kv-eviction", "ada-snapkv", "--kv-budget", str(BUDGET))
USAGE = "vllm:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def vanilla(model_dir):
    with VLLMServer(model_dir, extra_args=COMMON_ARGS, kv_cache_space_gib=1) as server:
        yield server


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kept")


@pytest.fixture(scope="module")
def evicting(model_dir, dump_dir):
    args, env = COMMON_ARGS + EVICTION_ARGS, {DEBUG_DUMP_ENV: str(dump_dir)}
    with VLLMServer(model_dir, extra_args=args, kv_cache_space_gib=1, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def client_of(server: VLLMServer):
    return openai_client(server, timeout_s=600)


TRAVELLERS = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy"]


def named_traveller(text: str) -> str | None:
    """The traveller an answer names first (None: it names none)."""
    found = {text.index(name): name for name in TRAVELLERS if name in text}
    return found[min(found)] if found else None


def travel_log(num_tokens: int, tokenizer, seed: int) -> str:
    """A deterministic prose-like prompt of about ``num_tokens`` tokens ending in a question."""
    rng = random.Random(seed)
    names = TRAVELLERS
    cities = ["Paris", "Lima", "Oslo", "Cairo", "Quito", "Seoul", "Perth", "Rome", "Tunis", "Riga"]
    question = "\nQuestion: who travelled to Riga, and what did they pay? Answer:"
    lines = ["Travel log of the club."]
    while len(tokenizer("\n".join(lines) + question)["input_ids"]) < num_tokens:
        day = len(lines)
        lines.append(
            f"On day {day}, {rng.choice(names)} went from {rng.choice(cities)} to {rng.choice(cities)} "
            f"by {rng.choice(['train', 'bus', 'boat', 'plane'])} and paid {rng.randint(10, 99)} coins."
        )
    return "\n".join(lines) + question


def greedy(server: VLLMServer, prompt: str, max_tokens: int) -> str:
    result = client_of(server).completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return result.choices[0].text


def wait_for_usage(server: VLLMServer, expected: float, timeout_s: float = 60.0) -> float:
    """Poll the usage gauge until it equals ``expected``; returns the last value seen."""
    return server.wait_for_metric(USAGE, expected, timeout_s)


def usage_while_decoding(server: VLLMServer, prompt: str, chunks_before_reading: int = 6) -> float:
    """``vllm:kv_cache_usage_perc`` read while the only request decodes (after its first chunks)."""
    stream = client_of(server).completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=64, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    usage = None
    for index, _chunk in enumerate(stream):
        if index == chunks_before_reading:
            usage = server.metric_value(USAGE)
    assert usage is not None, "the stream ended before the usage could be read"
    return usage


VARIED_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Translate to French: Good morning, my friend.",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Q: What is 12 times 12?\nA:",
    "import numpy as np\n# compute the mean of an array\n",
    "The largest planet in the solar system is",
    "Dear team, I am writing to",
    "A recipe for pancakes: first,",
    "SELECT name FROM users WHERE",
    "The theory of relativity states that",
    "Roses are red, violets are blue,",
]


def varied_prompts(tokenizer) -> list[str]:
    """20 prompts from 5 to ~450 tokens, all within the 512-token budget."""
    long_ones = [travel_log(n, tokenizer, seed=n) for n in (120, 250, 330, 400, 450)]
    prompts = VARIED_PROMPTS + long_ones
    assert len(prompts) == 20
    assert max(len(tokenizer(p)["input_ids"]) for p in prompts) <= BUDGET
    return prompts


def greedy_batch(server: VLLMServer, prompts: list[str], max_tokens: int) -> list[Greedy]:
    """One completion request carrying every prompt, each answer exactly ``max_tokens`` long with its top-5
    log-probabilities: the server admits them together (~2.4k prompt tokens, within one step's 8192)."""
    result = client_of(server).completions.create(
        model=server.served_model_name, prompt=prompts, max_tokens=max_tokens, temperature=0, logprobs=5,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return [Greedy.of(choice) for choice in sorted(result.choices, key=lambda choice: choice.index)]


#: how far below vanilla's own choice (nats) the evicting server's first differing token may lie. Both
#: servers get the same 20 requests, but their engines need not admit them in the same steps, and bf16 rounds
#: by the shape of the batch (greedy_answers.py): on a CPU with AMX tiles one CI run of the former exact check
#: found at least 2 of 20 answers parting, every prompt within the budget.
NEAR_TIE_NATS = 1.0


def test_budget_at_least_prompt_gives_the_same_greedy_outputs_as_vanilla(
    vanilla, evicting, dump_dir, tokenizer
):
    prompts = varied_prompts(tokenizer)
    dumped_before = set(dump_dir.glob("*.pt"))
    expected = greedy_batch(vanilla, prompts, 16)
    got = greedy_batch(evicting, prompts, 16)
    assert set(dump_dir.glob("*.pt")) == dumped_before, "a prompt within the budget was compacted"
    assert [len(answer.ids) for answer in expected + got] == [16] * 2 * len(prompts)
    for vanilla_answer, evicting_answer in zip(expected, got, strict=True):
        assert_same_or_parting_at_a_near_tie(vanilla_answer, evicting_answer, NEAR_TIE_NATS)
    identical = sum(a.ids == b.ids for a, b in zip(expected, got, strict=True))
    assert identical >= len(prompts) // 2, f"only {identical} of {len(prompts)} answers are identical"


def test_kv_cache_usage_while_decoding_a_3k_prompt_is_at_most_0_4_of_vanilla(vanilla, evicting, tokenizer):
    prompt = travel_log(3000, tokenizer, seed=4)
    assert wait_for_usage(vanilla, 0.0) == 0.0 and wait_for_usage(evicting, 0.0) == 0.0
    full = usage_while_decoding(vanilla, prompt)
    evicted = usage_while_decoding(evicting, prompt)
    assert full > 0 and evicted > 0
    # ada-snapkv at 512 tokens per head keeps ~6 of the prompt's 24 blocks of 128 tokens.
    assert evicted <= 0.4 * full, f"usage with eviction {evicted:.4f} vs vanilla {full:.4f}"


def test_eight_concurrent_mixed_requests_all_answer_and_free_every_block(evicting, tokenizer):
    lengths = [1600, 40, 1100, 300, 800, 12, 2000, 480]  # four compact, four stay below the budget
    prompts = [travel_log(n, tokenizer, seed=n) if n > 20 else "The capital of Italy is" for n in lengths]
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda p: client_of(evicting).completions.create(
            model=evicting.served_model_name, prompt=p, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True},
        ), prompts))
    assert [a.usage.completion_tokens for a in answers] == [24] * 8
    assert all(a.choices[0].finish_reason == "length" for a in answers)
    assert wait_for_usage(evicting, 0.0) == 0.0, "blocks leaked after all requests finished"


def test_aborting_a_compacted_request_mid_decode_returns_its_blocks(evicting, tokenizer):
    prompt = travel_log(2500, tokenizer, seed=7)
    assert wait_for_usage(evicting, 0.0) == 0.0
    stream = client_of(evicting).completions.create(
        model=evicting.served_model_name, prompt=prompt, max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    for index, _chunk in enumerate(stream):
        if index == 5:
            assert evicting.metric_value(USAGE) > 0
            break
    stream.close()  # the server sees the client go away and aborts the request
    assert wait_for_usage(evicting, 0.0) == 0.0, "the aborted request's blocks were not returned"
    assert greedy(evicting, "The capital of France is", 8).strip(), "server unusable after the abort"


# ----- per-request settings: vllm_xargs (issue 14) -------------------------------------------------------
NUM_LAYERS = 30  # SmolLM2-135M


def block_size_of(server: VLLMServer) -> int:
    """The block size the server runs with, from its start-up summary line."""
    found = re.search(r"kv-eviction active: .* block size (\d+);", server.log_path.read_text())
    assert found, "no 'kv-eviction active' line in the server log"
    return int(found.group(1))


def dumped_requests(paths: set[Path], prompt_len: int) -> list[list[list[int]]]:
    """[layer][kv head] kept counts of every dumped request (debug dump files) with this prompt length."""
    import torch

    records = [torch.load(path) for path in paths]
    return [[c.tolist() for c in r["counts"]] for r in records if r["prompt_len"] == prompt_len]


def kept_counts_by_prompt_len(paths: set[Path], prompt_len: int) -> list[list[int]]:
    """[layer][kv head] kept counts of the one dumped request with this prompt length."""
    matching = dumped_requests(paths, prompt_len)
    assert len(matching) == 1, f"{len(matching)} dumped requests with a {prompt_len}-token prompt"
    return matching[0]


def method_total(server: VLLMServer, name: str, method: str) -> float:
    return sum(v for labels, v in server.metric_samples(name) if labels.get("method") == method)


def complete(server: VLLMServer, prompt: str, xargs: dict | None, max_tokens: int = 16):
    return client_of(server).completions.create(
        model=server.served_model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"vllm_xargs": xargs} if xargs is not None else None,
    )


def test_two_concurrent_requests_compact_to_their_own_budgets(evicting, dump_dir, tokenizer):
    """One request at 10% of its prompt with the server's method, one at 300 tokens per head with SnapKV."""
    cases = [
        (travel_log(1500, tokenizer, seed=41), {"kv_budget": 0.1}, "ada-snapkv", 0.1),
        (travel_log(1100, tokenizer, seed=42), {"kv_eviction": "snapkv", "kv_budget": 300}, "snapkv", 300),
    ]
    compacted = "vllm_kvevict_requests_compacted_total"
    before = {method: method_total(evicting, compacted, method) for _, _, method, _ in cases}
    dumped_before = set(dump_dir.glob("*.pt"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(lambda case: complete(evicting, case[0], case[1]), cases))
    new_dumps = set(dump_dir.glob("*.pt")) - dumped_before
    block_size = block_size_of(evicting)
    prompt_lens = [answer.usage.prompt_tokens for answer in answers]
    assert len(set(prompt_lens)) == 2
    for answer, prompt_len, (_, _, method, budget) in zip(answers, prompt_lens, cases, strict=True):
        assert answer.usage.completion_tokens > 0
        plan = plan_request(prompt_len, budget, block_size, build_policy(method), NUM_LAYERS)
        assert plan.compacts
        kept = kept_counts_by_prompt_len(new_dumps, prompt_len)
        assert [sum(heads) / len(heads) for heads in kept] == list(plan.layer_budgets)
        assert method_total(evicting, compacted, method) == before[method] + 1
    # The two budgets differ: 10% of 1500 tokens is ~150 per head, the other asked for 300.
    totals = [sum(map(sum, kept_counts_by_prompt_len(new_dumps, n))) for n in prompt_lens]
    assert totals[0] < totals[1]
    assert "failed on request" not in evicting.log_path.read_text(), "a policy fell back to recent tokens"
    assert wait_for_usage(evicting, 0.0) == 0.0, "blocks leaked after per-request compaction"


def test_kv_eviction_none_gives_the_same_greedy_output_as_vanilla(vanilla, evicting, dump_dir, tokenizer):
    prompt = travel_log(1300, tokenizer, seed=43)  # far above the server's 512-token budget
    skipped = "vllm_kvevict_requests_skipped_total"
    before = method_total(evicting, skipped, "none")
    dumped_before = set(dump_dir.glob("*.pt"))
    kept_whole = complete(evicting, prompt, {"kv_eviction": "none"}, max_tokens=32)
    expected = complete(vanilla, prompt, None, max_tokens=32)
    assert kept_whole.choices[0].text == expected.choices[0].text
    assert method_total(evicting, skipped, "none") == before + 1
    assert set(dump_dir.glob("*.pt")) == dumped_before, "a request with kv_eviction=none was compacted"


BAD_XARGS = [
    ({"kv_eviction": "bogus"}, ["'bogus' is not a known method", "valid: none, snapkv"]),
    ({"kv_budget": 0}, ["kv_budget=0 is out of range", "an integer >= 1"]),
    ({"kv_budget": -3}, ["kv_budget=-3 is out of range"]),
    ({"kv_budget": "lots"}, ["kv_budget='lots' is a string, not a number"]),
    ({"kv_budget": 1.5}, ["kv_budget=1.5 is out of range", "a float in (0, 1)"]),
    ({"kv_eviction": "critical-snapkv"}, ["'critical-snapkv' cannot run per request on this server",
                                          "valid: none, snapkv"]),
    ({"kv_budget": 8}, ["kv_budget=8 is below the 32 tokens ada-snapkv always keeps", "an integer >= 32"]),
    ({"kv_prefill": "streamed"}, ["kv_prefill='streamed' is not valid", "valid: chunked, whole"]),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_each_bad_value_is_a_400_naming_it_and_the_server_keeps_serving(evicting, endpoint, stream):
    import openai

    client = client_of(evicting)
    for xargs, fragments in BAD_XARGS:
        with pytest.raises(openai.BadRequestError) as raised:
            if endpoint == "completions":
                client.completions.create(model=evicting.served_model_name, prompt="Hello", max_tokens=4,
                                          stream=stream, extra_body={"vllm_xargs": xargs})
            else:
                client.chat.completions.create(model=evicting.served_model_name, max_tokens=4,
                                               messages=[{"role": "user", "content": "Hello"}],
                                               stream=stream, extra_body={"vllm_xargs": xargs})
        assert raised.value.status_code == 400
        for fragment in fragments:
            assert fragment in raised.value.message, (xargs, raised.value.message)
    good = client.chat.completions.create(model=evicting.served_model_name, max_tokens=4,
                                          messages=[{"role": "user", "content": "Hello"}],
                                          extra_body={"vllm_xargs": {"kv_budget": 0.5}})
    assert good.choices[0].message.content is not None
    assert wait_for_usage(evicting, 0.0) == 0.0


# ----- tensor parallelism (issue 14) -----------------------------------------------------------------------
# SmolLM2-135M has 9 query heads: vLLM admits TP sizes 1, 3 and 9 only. TP=3 gives each rank 3 query heads
# and 1 KV head; the three ranks share this xdist worker's cores (``rank_binding``).
TP_SIZE = 3


@pytest.fixture(scope="module")
def evicting_tp3(model_dir, rank_binding):
    args = (*COMMON_ARGS, *EVICTION_ARGS, "--tensor-parallel-size", str(TP_SIZE))
    env = {"VLLM_CPU_OMP_THREADS_BIND": rank_binding(TP_SIZE)}
    # Three ranks on shared cores: start-up took 106-393 s here, and once timed out at 600 s (load 24).
    server = VLLMServer(model_dir, extra_args=args, kv_cache_space_gib=1, env=env, startup_timeout_s=1500)
    with server:
        yield server


def test_tensor_parallel_3_answers_like_one_rank_and_counts_requests_once(evicting, evicting_tp3, tokenizer):
    """Within the budget, and compacted with per-head SnapKV: the same text. With the learned scorer (each
    rank scores its own KV head with its slice of the packaged scorer) the same traveller named: its bf16
    scores sit near a tie at the first token, where one rank's text changed between runs of the module."""
    prompt = travel_log(1400, tokenizer, seed=44)
    cases = [("The capital of France is", None),
             (prompt, {"kv_eviction": "snapkv", "kv_budget": 256}),
             (prompt, {"kv_eviction": "kvzap", "kv_budget": 256})]  # fmt: skip
    compacted = "vllm_kvevict_requests_compacted_total"
    before = {method: method_total(evicting_tp3, compacted, method) for method in ("snapkv", "kvzap")}
    for prompt, xargs in cases:
        one_rank = complete(evicting, prompt, xargs, max_tokens=24).choices[0].text
        three_ranks = complete(evicting_tp3, prompt, xargs, max_tokens=24).choices[0].text
        if xargs is None or xargs["kv_eviction"] != "kvzap":
            assert three_ranks == one_rank, xargs
        else:  # before each rank had its slice, every layer fell back and TP=3 answered ":::::"
            named = named_traveller(one_rank)
            assert named is not None and named_traveller(three_ranks) == named, (three_ranks, one_rank)
    for method, count in before.items():
        assert method_total(evicting_tp3, compacted, method) == count + 1  # not once per rank
    assert method_total(evicting_tp3, "vllm_kvevict_policy_fallbacks_total", "kvzap") == 0.0
    assert wait_for_usage(evicting_tp3, 0.0) == 0.0
