"""A compressed document asked many questions (``vllm_xargs.kv_context: "keep"``): one prefill instead of one
per question, and the answers of HF's question-agnostic run over the same document.

Per ``--seeds`` seed one document (essay prose, ``--tokens`` long, eight keyed 7-digit needles at evenly
spread depths) and eight questions, one per needle. Servers, one after the other, same KV pool:

- vanilla vLLM at its defaults (prefix caching on): the eight questions in order; the first computes the
  document, the others find it in the prefix cache (full KV);
- an eviction server (``--kv-eviction snapkv --kv-budget 0.25``, or ``--eviction-server FLAGS``): for each
  setting (``--setting METHOD:FRACTION``, asked per request), the document alone with ``kv_context:
  "keep"`` (the creator, one token), then the eight questions with ``kv_context: "keep"`` (readers of the
  kept context); with ``--per-question``, also the eight questions compressed one by one (question-aware,
  each its own ``cache_salt``: no reuse).

TTFT is measured by streaming (first token received). Each answer is scored (the needle's value in the
output). HF transformers (float32) then runs the question-agnostic mode the readers serve: the document's
block-aligned part compressed alone by the same method and budget as the server keeps it (``ada-snapkv``
as ``ada-kvzap`` with the packaged scorer; Ada-KV's head budgets in whole blocks;
``accounting.plan_request`` of that length; with the eviction server's ``budget_scope: "model"``, its
parameters and every layer ranked together, each (layer, head) in whole blocks), each question run on the
compressed cache, greedy. Prints one
table per setting; ``--out`` saves everything as JSON.

    python -m benchmarks.kept_context --tokens 7000 --seeds 0,1,2 --setting snapkv:0.25 --setting snapkv:0.1 \
        --setting expected-attention:0.25 --setting expected-attention:0.1 --per-question \
        --out docs/results/2026-11-27-kept-context/kept_context.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shlex
import time
from pathlib import Path

import torch

from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.evaluation.haystacks import haystack_sentences, insert_at_depths
from vllm_kvevict.evaluation.tasks.needles import INSTRUCTION, distinct_keys, distinct_values, needle
from vllm_kvevict.server_process import VLLMServer

BLOCK_SIZE = 32
NEEDLES = 8
NEW_TOKENS = 12
SERVER_ARGS = ("--block-size", str(BLOCK_SIZE), "--max-model-len", "8192")
DEFAULT_EVICTION = ("--kv-eviction", "snapkv", "--kv-budget", "0.25")


@dataclasses.dataclass(frozen=True)
class Document:
    ids: list[int]
    questions: list[list[int]]  # token ids appended to the document
    answers: list[str]


def build_document(tokenizer, target_tokens: int, seed: int = 0) -> Document:
    rng = random.Random(seed)
    keys, values = distinct_keys(rng, NEEDLES), distinct_values(rng, NEEDLES)
    depths = [(i + 0.5) / NEEDLES for i in range(NEEDLES)]
    words = int(target_tokens * 0.7)
    while True:
        sentences = haystack_sentences("essay", seed, words)
        text = (
            INSTRUCTION
            + "\n\n"
            + insert_at_depths(sentences, [needle(k, v) for k, v in zip(keys, values, strict=True)], depths)
        )
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= target_tokens:
            break
        words = int(words * 1.05) + 10
    questions = [
        tokenizer(
            f"\n\nQuestion: What is the special magic number for {key} mentioned in the provided text?\n"
            f"Answer: The special magic number for {key} mentioned in the provided text is"
        )["input_ids"]
        for key in keys
    ]
    return Document(ids, questions, values)


def stream_ttft(client, model: str, prompt: list[int], xargs: dict | None, salt: str | None = None):
    """(seconds to the first streamed token, the whole greedy output)."""
    body: dict = {}
    if xargs:
        body["vllm_xargs"] = xargs
    if salt:
        body["cache_salt"] = salt
    start = time.perf_counter()
    first, text = None, ""
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True, extra_body=body
    ):
        if first is None:
            first = time.perf_counter() - start
        text += chunk.choices[0].text if chunk.choices else ""
    return first, text


def served_runs(
    model_dir: Path,
    documents: list[Document],
    settings: list[tuple[str, float]],
    per_question: bool,
    eviction_flags: tuple[str, ...] = DEFAULT_EVICTION,
) -> list[dict]:
    """Per document: vanilla's answers and TTFTs, then each setting's creator and readers (one server each
    for all documents; a document's entries are its own: its tokens differ)."""
    from openai import OpenAI

    runs: list[dict] = [{"vanilla": [], "settings": {}} for _ in documents]
    with VLLMServer(model_dir, extra_args=SERVER_ARGS, enforce_eager=True) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=1800, max_retries=0)
        for document, run in zip(documents, runs, strict=True):
            for question in document.questions:
                run["vanilla"].append(
                    stream_ttft(client, server.served_model_name, document.ids + question, None)
                )
    evicting = (*SERVER_ARGS, *eviction_flags)
    with VLLMServer(model_dir, extra_args=evicting, enforce_eager=True) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=1800, max_retries=0)
        model = server.served_model_name
        for document, runs_of_document in zip(documents, runs, strict=True):
            for method, fraction in settings:
                keep = {"kv_eviction": method, "kv_budget": fraction, "kv_context": "keep"}
                label = f"{method}:{fraction}"
                run = {"creator": stream_ttft(client, model, document.ids, keep)}
                run["readers"] = [
                    stream_ttft(client, model, document.ids + q, keep) for q in document.questions
                ]
                run["contexts"] = {
                    s[0]["event"]: s[1] for s in server.metric_samples("vllm_kvevict_kept_contexts_total")
                }
                if per_question:
                    own = {"kv_eviction": method, "kv_budget": fraction}
                    run["per_question"] = [
                        stream_ttft(client, model, document.ids + q, own, salt=f"{label}-{i}")
                        for i, q in enumerate(document.questions)
                    ]
                runs_of_document["settings"][label] = run
    return runs


def server_method(flags: tuple[str, ...]) -> tuple[str, dict]:
    """(method, parameters) of the eviction server's flags, read by the server's own flag parser (presets
    resolved, the schedule's keys apart)."""
    from vllm_kvevict.vllm_adapter.eviction_flags import add_eviction_args, eviction_config_from_args

    parser = argparse.ArgumentParser()
    add_eviction_args(parser)
    args, _ = parser.parse_known_args(list(flags))
    config = eviction_config_from_args(args, None)
    assert config is not None, f"no --kv-eviction in {flags}"
    return config.method, dict(config.params)


def hf_agnostic(
    model_dir: Path, documents: list[Document], settings: list[tuple[str, float]], server: tuple[str, dict]
) -> list[dict[str, list[str]]]:
    """Per document and setting, HF's greedy answers to each question over the document compressed alone."""
    from vllm_kvevict.hf_reference import load_reference_model
    from vllm_kvevict.policies import served_scorer

    model, tokenizer = load_reference_model(model_dir, dtype=torch.float32)
    served_scorer.serve_model(model.config, model_dir.name)  # the packaged scorer, as the server finds it
    return [hf_agnostic_document(model, tokenizer, document, settings, server) for document in documents]


def hf_agnostic_document(
    model, tokenizer, document: Document, settings: list[tuple[str, float]], server: tuple[str, dict]
) -> dict[str, list[str]]:
    """Per setting, HF's greedy answers to each question of ``document`` over it compressed alone, by the
    method as the server keeps a context (the server's parameters where it is the server's method)."""
    from vllm_kvevict.hf_reference import (
        context_layers,
        decode_with_kept,
        kept_per_layer,
        kept_ranked_across_layers,
        prefill,
    )
    from vllm_kvevict.layout.accounting import plan_request
    from vllm_kvevict.policies.registry import build_policy
    from vllm_kvevict.settings.learned_methods import kept_context_method

    prompt = prefill(model, torch.tensor(document.ids), query_window=None)
    context_len = BLOCK_SIZE * (len(document.ids) // BLOCK_SIZE)
    layers = context_layers(prompt, context_len, None)
    answers = {}
    for method, fraction in settings:
        # as the server keeps it: the served default as the learned method, heads in whole blocks
        name = kept_context_method(method)
        params = server[1] if name == server[0] else {}
        policy = build_policy(name, **params).kept_context_form(BLOCK_SIZE)
        assert policy is not None, f"{method} keeps no context"
        plan = plan_request(context_len, fraction, BLOCK_SIZE, policy, len(layers))
        if policy.pools_layers:  # ranked across layers, every (layer, head) in whole sub-blocks
            kept = kept_ranked_across_layers(policy, layers, plan.layer_budgets, BLOCK_SIZE)
        else:
            kept = kept_per_layer(policy, layers, plan.kept_bound)
        outputs = []
        for question in document.questions:
            asked = dataclasses.replace(prompt, input_ids=torch.tensor(document.ids + question))
            tokens, _ = decode_with_kept(
                model,
                asked,
                kept,
                NEW_TOKENS,
                context_len=context_len,
                stop_token_ids=[tokenizer.eos_token_id],
            )
            outputs.append(tokenizer.decode(tokens, skip_special_tokens=True))
        answers[f"{method}:{fraction}"] = outputs
    return answers


def correct(outputs: list[str], answers: list[str]) -> int:
    return sum(answer in output for output, answer in zip(outputs, answers, strict=True))


def report(document: Document, runs: dict, hf: dict[str, list[str]]) -> str:
    lines = []
    vanilla = runs["vanilla"]
    lines.append(
        f"document {len(document.ids)} tokens, {NEEDLES} questions; vanilla (prefix caching, full KV): "
        f"TTFT q1 {vanilla[0][0]:.2f} s, q2-8 median {sorted(t for t, _ in vanilla[1:])[3]:.3f} s, "
        f"correct {correct([o for _, o in vanilla], document.answers)}/{NEEDLES}"
    )
    for label, run in runs["settings"].items():
        creator = run["creator"][0]
        readers = [t for t, _ in run["readers"]]
        lines.append(f"\n{label}: creator (the one prefill) TTFT {creator:.2f} s; contexts {run['contexts']}")
        lines.append("| | TTFT q1 | TTFT q2-8 (median, max) | max reader TTFT / creator TTFT | correct |")
        lines.append("|---|---|---|---|---|")
        rest = sorted(readers[1:])
        right = correct([o for _, o in run["readers"]], document.answers)
        lines.append(
            f"| kept context (readers) | {readers[0]:.3f} s | {rest[3]:.3f} s, {rest[-1]:.3f} s | "
            f"{max(readers) / creator:.3f} | {right}/{NEEDLES} |"
        )
        if "per_question" in run:
            own = [t for t, _ in run["per_question"]]
            rest = sorted(own[1:])
            lines.append(
                f"| compressed per question (question-aware, no reuse) | {own[0]:.3f} s | {rest[3]:.3f} s, "
                f"{rest[-1]:.3f} s | {max(own) / creator:.3f} | "
                f"{correct([o for _, o in run['per_question']], document.answers)}/{NEEDLES} |"
            )
        if label in hf:
            same = sum(a.strip() == b.strip() for a, (_, b) in zip(hf[label], run["readers"], strict=True))
            lines.append(
                f"| HF question-agnostic (float32) | | | | {correct(hf[label], document.answers)}/{NEEDLES} "
                f"(readers' text identical on {same}/{NEEDLES}) |"
            )
    return "\n".join(lines)


def totals(documents: list[Document], runs: list[dict], hf: list[dict[str, list[str]]]) -> str:
    """One line per setting: correct answers over every document, readers and HF, against vanilla's."""
    asked = NEEDLES * len(documents)
    pairs = list(zip(documents, runs, strict=True))
    vanilla = sum(correct([o for _, o in r["vanilla"]], d.answers) for d, r in pairs)
    lines = [f"\n{len(documents)} documents, {asked} questions: vanilla {vanilla}/{asked}"]
    for label in runs[0]["settings"]:
        readers = sum(
            correct([o for _, o in r["settings"][label]["readers"]], d.answers)
            for d, r in pairs
        )
        line = f"{label}: readers {readers}/{asked} ({readers / max(vanilla, 1):.2f}x vanilla)"
        if hf and label in hf[0]:
            agnostic = sum(correct(h[label], d.answers) for d, h in zip(documents, hf, strict=True))
            line += f", HF question-agnostic {agnostic}/{asked}"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--setting", action="append", default=None, help="METHOD:FRACTION (repeatable)")
    parser.add_argument("--seeds", default="0", help="comma list: a document per seed")
    parser.add_argument("--per-question", action="store_true")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument(
        "--eviction-server",
        type=shlex.split,
        default=list(DEFAULT_EVICTION),
        help="the eviction server's flags (its requests name their method per setting)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    settings = [(s.split(":")[0], float(s.split(":")[1])) for s in (args.setting or ["snapkv:0.25"])]
    from transformers import AutoTokenizer

    model_dir = prepared_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    seeds = [int(seed) for seed in args.seeds.split(",")]
    documents = [build_document(tokenizer, args.tokens, seed) for seed in seeds]
    runs = served_runs(model_dir, documents, settings, args.per_question, tuple(args.eviction_server))
    server = server_method(tuple(args.eviction_server))
    hf = [] if args.no_hf else hf_agnostic(model_dir, documents, settings, server)
    for index, (document, run) in enumerate(zip(documents, runs, strict=True)):
        print(f"\n## document of seed {seeds[index]}")
        print(report(document, run, hf[index] if hf else {}))
    print(totals(documents, runs, hf))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = [
            {"seed": seed, "tokens": len(d.ids), "answers": d.answers, "runs": r, "hf": hf[i] if hf else {}}
            for i, (seed, d, r) in enumerate(zip(seeds, documents, runs, strict=True))
        ]
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
