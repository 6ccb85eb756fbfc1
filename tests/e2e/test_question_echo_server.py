"""The question echo through a real server equals HF's echo (``hf_reference.probe.echo_queries``).

``vllm serve --kv-eviction ada-snapkv --kv-budget 0.25 --kv-eviction-config '{"question_echo": 32, ...}'``
compiled (vLLM's default: the echo must run the model's own forward, not the step's compiled graph), in
float32, with vLLM's chunked prefill at 256 tokens per step and ``"echo_between_chunks": true``. A chat
prompt with its question before a ~1,000-token document (``qfirst_niah_single_essay`` from ``eval``'s
generator) is echoed: its last user turn's first 32 tokens run again after the prompt, and their queries
with the prompt's own last 32 judge its compaction. Beside it in the same steps: a plain completion prompt
with the question first (``rag_niah_single_essay``: no user header, echoed by its first 32 tokens), a chat
prompt with the question in its own system message (``qsystem_niah_single_essay``: the system message's
last 32 tokens and the user turn's first 32 are echoed), another question-first prompt asking
``kv_question_echo: 0`` (judged by its window alone), two question-first prompts evicted chunk by chunk
(``kv_prefill: chunked``; one with the echo after every evicting chunk: the user turn's first 32 tokens and
the prompt's last 32, run after the tokens so far, judge the held entries; one asking no echo, the control)
and a ``kv_eviction: "none"`` request.

HF transformers (float32) computes the kept sets independently: the echo's queries from a cache copy of the
prompt (the echo's tokens by the same rule on HF's tokenizer, ``probe.head_tokens``), the method judging
with its window and the echo's queries; per chunk ``hf_reference.chunked.chunked_prefill`` with
``between_echo``. The served kept entries must match HF's echo selection, and differ from the window-only
selection (the control that lets the check fail); decoding must follow HF with the served kept sets; the
first token is the full prompt's own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from reference_checks import logprob_gap, tokens_and_logprobs

from vllm_kvevict.datapath.records import DEBUG_DUMP_ENV
from vllm_kvevict.server_process import VLLMServer, startup_timeout_for

pytestmark = [pytest.mark.e2e, pytest.mark.model]

WIDTH = 32
NEW_TOKENS = 24
CHUNK = 256  # vLLM's chunk and the stride at which a prompt evicted chunk by chunk is evicted
CHUNK_BUDGET = 128
SERVER_ARGS = (
    "--kv-eviction", "ada-snapkv", "--kv-budget", "0.25", "--block-size", "32", "--max-model-len", "2048",
    "--dtype", "float32", "--enable-chunked-prefill", "--max-num-batched-tokens", str(CHUNK),
    "--kv-eviction-config",
    f'{{"question_echo": {WIDTH}, "chunk_budget": {CHUNK_BUDGET}, "echo_between_chunks": true}}',
)  # fmt: skip
USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class Served:
    """One request's greedy tokens [T], their logprobs [T] and the worker's dump of its kept entries."""

    prompt_ids: list[int]
    tokens: torch.Tensor
    logprobs: torch.Tensor
    kept: list  # per layer KeptTokens
    chunks: list  # (tokens computed, per layer KeptTokens held) after each evicting chunk before the last


def overlap(served, reference) -> float:
    """Mean over layers and KV heads of |served ∩ reference| / |reference| of the kept positions."""
    shares = []
    for got, want in zip(served, reference, strict=True):
        for head in range(want.counts.shape[0]):
            a, b = set(got.head(head).tolist()), set(want.head(head).tolist())
            shares.append(len(a & b) / max(1, len(b)))
    return sum(shares) / len(shares)


def layer_budgets(kept) -> list[int]:
    return [int(k.counts.sum()) // k.counts.shape[0] for k in kept]


@pytest.fixture(scope="module")
def reference(model_dir):
    from vllm_kvevict.hf_reference.model import load_reference_model

    return load_reference_model(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory, reference) -> dict[str, Served]:
    from openai import OpenAI

    from vllm_kvevict.evaluation.generate import generate_sample
    from vllm_kvevict.evaluation.prompt_format import PromptFormat
    from vllm_kvevict.evaluation.tasks import get_task
    from vllm_kvevict.policies.base import KeptTokens

    task, fmt = get_task("qfirst_niah_single_essay"), PromptFormat.from_path(model_dir)
    completion, system = get_task("rag_niah_single_essay"), get_task("qsystem_niah_single_essay")
    prompts = {
        "echo": list(generate_sample(task, fmt, 1024, seed=0, index=0).token_ids),
        "completion": list(generate_sample(completion, fmt, 960, seed=0, index=4).token_ids),
        "system": list(generate_sample(system, fmt, 1060, seed=0, index=5).token_ids),
        "off": list(generate_sample(task, fmt, 900, seed=0, index=1).token_ids),  # asks for no echo
        "chunked": list(generate_sample(task, fmt, 1150, seed=0, index=2).token_ids),
        "chunked-off": list(generate_sample(task, fmt, 1100, seed=0, index=3).token_ids),
    }
    xargs = {
        "off": {"kv_question_echo": 0},
        "chunked": {"kv_prefill": "chunked"},
        "chunked-off": {"kv_prefill": "chunked", "kv_question_echo": 0},
    }
    assert len({len(ids) for ids in prompts.values()}) == 6  # the dumps are told apart by prompt length
    dump_dir = tmp_path_factory.mktemp("kept")
    # compiled, as vLLM serves by default: the echo forward must not run through the step's compiled graph
    served_at_defaults = {"enforce_eager": False, "startup_timeout_s": startup_timeout_for(False)}
    with VLLMServer(
        model_dir, extra_args=SERVER_ARGS, env={DEBUG_DUMP_ENV: str(dump_dir)}, **served_at_defaults
    ) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=1800, max_retries=0)

        def complete(ids: list[int], xargs: dict | None = None):
            # its own cache salt: no request starts from another's blocks in vLLM's prefix cache
            extra = {"ignore_eos": True, "return_tokens_as_token_ids": True, "cache_salt": str(xargs)}
            if xargs:
                extra["vllm_xargs"] = xargs
            return client.completions.create(
                model=server.served_model_name, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, logprobs=1,
                extra_body=extra,
            )  # fmt: skip

        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = {name: pool.submit(complete, ids, xargs.get(name)) for name, ids in prompts.items()}
            full = pool.submit(complete, prompts["echo"], {"kv_eviction": "none"})
            outputs = {name: f.result() for name, f in futures.items()}
            assert full.result().usage.completion_tokens == NEW_TOKENS
        assert server.wait_for_metric(USAGE, 0.0, 60.0) == 0.0
    records = {r["prompt_len"]: r for r in (torch.load(p) for p in Path(dump_dir).glob("*.pt"))}
    result = {}
    for name, ids in prompts.items():
        record = records[len(ids)]
        tokens, logprobs = tokens_and_logprobs(outputs[name].choices[0].logprobs)
        kept = [KeptTokens(i, c) for i, c in zip(record["indices"], record["counts"], strict=True)]
        chunks = [(end, [KeptTokens(i, c) for i, c in held]) for end, held in record.get("chunks", [])]
        result[name] = Served(ids, tokens, logprobs, kept, chunks)
    return result


def hf_kept(reference, ids: list[int], budgets: list[int], echo: bool) -> list:
    """HF's kept sets of ``ids`` by the server's method: judged by its window, or with the echo."""
    from vllm_kvevict.datapath.question_echo import echo_policy
    from vllm_kvevict.hf_reference import prefill
    from vllm_kvevict.hf_reference.probe import echo_queries, head_tokens, probed_layers
    from vllm_kvevict.settings.config import EvictionConfig

    model, tokenizer = reference
    policy = EvictionConfig.from_dict({"method": "ada-snapkv", "budget": 0.25}).build_policy()
    whole = prefill(model, torch.tensor(ids), query_window=2 * WIDTH)
    layers = whole.layers
    if echo:
        head = head_tokens(ids, tokenizer, WIDTH)
        assert len(head) in (WIDTH, 2 * WIDTH)  # two spans: an own system message and the user turn
        layers = probed_layers(whole.layers, echo_queries(model, whole, head), window=WIDTH)
        policy = echo_policy(policy, len(head))
    return [policy.select(layer, budget) for layer, budget in zip(layers, budgets, strict=True)]


def hf_chunked(reference, ids: list[int], echo: bool):
    """HF's per-chunk eviction of ``ids`` with the server's plan (chunks of ``CHUNK``, I = ``CHUNK_BUDGET``)
    and method, with the echo after every evicting chunk (its own token choice: ``probe.probe_tokens``, the
    user turn's first 32 and the prompt's last 32; at the last chunk ``probe.head_tokens``) or without."""
    from vllm_kvevict.hf_reference.chunked import chunked_prefill
    from vllm_kvevict.hf_reference.probe import head_tokens, probe_tokens
    from vllm_kvevict.layout.accounting import request_planner
    from vllm_kvevict.settings.config import EvictionConfig

    model, tokenizer = reference
    policy = EvictionConfig.from_dict({"method": "ada-snapkv", "budget": 0.25}).build_policy()
    planner = request_planner(0.25, 32, policy, model.config.num_hidden_layers, chunk_budget=CHUNK_BUDGET,
                              chunk_stride=CHUNK)  # fmt: skip
    head = head_tokens(ids, tokenizer, WIDTH) if echo else []
    between = probe_tokens(ids, tokenizer, WIDTH) if echo else []
    assert not echo or (len(head) == WIDTH and len(between) == 2 * WIDTH)
    return chunked_prefill(model, torch.tensor(ids), policy, planner(len(ids)), CHUNK, echo=head,
                           between_echo=between)  # fmt: skip


@pytest.mark.parametrize("name", ["echo", "completion", "system"])
def test_the_echoed_prompt_keeps_what_hf_echo_keeps_not_what_its_window_keeps(served, reference, name):
    run = served[name]
    budgets = layer_budgets(run.kept)
    with_echo = overlap(run.kept, hf_kept(reference, run.prompt_ids, budgets, echo=True))
    window_only = overlap(run.kept, hf_kept(reference, run.prompt_ids, budgets, echo=False))
    assert with_echo >= 0.97, f"served vs HF echo: {with_echo:.3f} (window only {window_only:.3f})"
    assert window_only < with_echo - 0.05, f"the echo changed little: {window_only:.3f} vs {with_echo:.3f}"


def agreement(run: Served, reference_run) -> list[float]:
    """Overlap of the served held entries with HF's after each evicting chunk, then of the final kept ones."""
    stages = zip(run.chunks, reference_run.chunks, strict=True)
    return [overlap(held, want) for (_, held), (_, want) in stages] + [overlap(run.kept, reference_run.kept)]


def test_a_prompt_evicted_per_chunk_holds_what_hf_holds_with_the_echo_after_each_chunk(served, reference):
    """Per chunk the served held sets follow HF's ``chunked_prefill`` with the echo after each chunk as
    closely as a request asking no echo follows HF without it (the float32 server and HF differ at the top-k
    boundary, and a difference carries into later chunks), and not HF without the echo."""
    run, control = served["chunked"], served["chunked-off"]
    with_echo = hf_chunked(reference, run.prompt_ids, echo=True)
    assert len(run.chunks) >= 2 and [end for end, _ in run.chunks] == [end for end, _ in with_echo.chunks]
    echoed = agreement(run, with_echo)
    window_only = agreement(run, hf_chunked(reference, run.prompt_ids, echo=False))
    floor = agreement(control, hf_chunked(reference, control.prompt_ids, echo=False))
    detail = f"echo {echoed}, served vs HF without echo {window_only}, control {floor}"
    assert echoed[0] >= 0.97 and min(echoed) >= min(floor) - 0.03, detail
    assert all(e > w + 0.04 for e, w in zip(echoed, window_only, strict=True)), detail


def test_a_prompt_asking_no_echo_is_judged_by_its_window(served, reference):
    run = served["off"]
    budgets = layer_budgets(run.kept)
    window_only = overlap(run.kept, hf_kept(reference, run.prompt_ids, budgets, echo=False))
    assert window_only >= 0.97, f"served vs HF window-only: {window_only:.3f}"
    # the control: the echo would have kept other entries
    assert overlap(run.kept, hf_kept(reference, run.prompt_ids, budgets, echo=True)) < window_only - 0.05


@pytest.mark.parametrize("name", ["echo", "completion", "chunked"])
def test_decoding_follows_hf_with_the_served_kept_entries(served, reference, name):
    from vllm_kvevict.hf_reference import prefill
    from vllm_kvevict.hf_reference.chunked import teacher_forced_after_chunks

    model, _ = reference
    run = served[name]
    masked = teacher_forced_after_chunks(model, run.prompt_ids, run.chunks, run.kept, run.tokens)
    gap = logprob_gap(run.logprobs, run.tokens, masked)
    assert float(gap.max()) < 0.05, f"|delta logprob| per step {gap.tolist()}"
    if run.chunks:  # the last chunk attended to what the earlier ones held
        return
    full = prefill(model, torch.tensor(run.prompt_ids), capture=False).last_logits
    assert int(full.argmax()) == int(run.tokens[0]), "the first token comes from the whole prompt"
