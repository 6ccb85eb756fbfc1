"""Window logits in the model's dtype against float32: how many kept tokens and answers change.

``policies/scoring.py`` takes ``q k^T`` out of the matmul in the inputs' dtype (bf16 in a served model, as
kvpress's presses do) and runs the softmax in float32. Here each prompt (the eval suite's tasks) is
prefilled once by the bundled model in bf16; every method then selects each layer's kept tokens twice from
the same captured tensors: as float32 (exact float32 logits) and as bf16 (the served path). For each
(method, kept fraction, shared prefix) it prints the share of kept tokens both choose, and, decoding the
answer from either kept set, how many answers differ and the task score of each.

``--shared N``: the first n - N tokens are a shared prefix kept whole (the prefix-cache path,
``select_after``), so only the last N tokens are chosen from, with the prefix in the softmax.

    .venv/bin/python benchmarks/policy_quality/logit_precision.py --length 4096 --samples 2 \
        --out docs/results/2026-11-28-prefix-caching/logit_precision.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from vllm_kvevict.evaluation.generate import generate_samples
from vllm_kvevict.evaluation.prompt_format import PromptFormat
from vllm_kvevict.evaluation.scoring import score
from vllm_kvevict.hf_reference import decode_with_kept, kvpress_kept_count, load_reference_model, prefill
from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens, LayerKV
from vllm_kvevict.policies.registry import build_policy

TASKS = "niah_single_essay,niah_multikey,niah_multivalue,vt"


def in_dtype(layer: LayerKV, dtype: torch.dtype) -> LayerKV:
    """``layer`` with keys, values and queries cast to ``dtype`` (exact: the capture came from bf16)."""
    assert layer.values is not None
    return dataclasses.replace(
        layer, keys=layer.keys.to(dtype), values=layer.values.to(dtype), queries=layer.queries.to(dtype)
    )


def kept_sets(
    policy: EvictionPolicy, layers: list[LayerKV], fraction: float, shared: int, dtype: torch.dtype
) -> list[KeptTokens]:
    """Per layer, what ``policy`` keeps at ``fraction`` of the tokens after a kept prefix of ``shared``."""
    kept = []
    for layer in layers:
        n = layer.num_tokens
        budget = kvpress_kept_count(n - shared, fraction)
        layer_budget = policy.layer_budget(budget, n - shared, layer.layer_idx, layer.num_layers)
        chosen = policy.select_after(in_dtype(layer, dtype), layer_budget, shared)
        if shared:  # the prefix is held whole, as a request that found it in the cache holds it
            mask = chosen.to_mask(n)
            mask[:, :shared] = True
            chosen = KeptTokens.from_mask(mask)
        kept.append(chosen)
    return kept


def decoded(model, tokenizer, prompt, kept: list[KeptTokens], max_new_tokens: int) -> str:
    """The greedy answer decoded after ``prompt`` from the ``kept`` sets."""
    out, _ = decode_with_kept(model, prompt, kept, max_new_tokens, stop_token_ids=[tokenizer.eos_token_id])
    return tokenizer.decode(out, skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ada-snapkv,snapkv,pyramidkv,nacl")
    parser.add_argument("--tasks", default=TASKS)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--fractions", default="0.25,0.1")
    parser.add_argument("--shared", default="0,400", help="comma list: tokens after a kept prefix (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    torch.manual_seed(args.seed)
    model, tokenizer = load_reference_model(prepared_model_dir(), torch.bfloat16)
    samples = generate_samples(
        args.tasks.split(","), [args.length], args.samples, args.seed, PromptFormat(tokenizer)
    )
    cells: dict[tuple[str, float, int], dict[str, float]] = {}
    for sample in samples:
        ids = torch.tensor(sample.token_ids)
        prompt = prefill(model, ids, query_window=64)
        n = prompt.num_tokens
        for method in args.methods.split(","):
            policy = build_policy(method)
            for fraction in [float(x) for x in args.fractions.split(",")]:
                for own in [int(x) for x in args.shared.split(",")]:
                    shared = n - own if own else 0
                    exact = kept_sets(policy, prompt.layers, fraction, shared, torch.float32)
                    served = kept_sets(policy, prompt.layers, fraction, shared, torch.bfloat16)
                    pairs = zip(exact, served, strict=True)
                    both = sum(int((a.to_mask(n) & b.to_mask(n)).sum()) for a, b in pairs)
                    total = sum(a.total for a in exact)
                    answers = [decoded(model, tokenizer, prompt, exact, sample.max_new_tokens)]
                    # the same kept sets decode the same answer: decode again only where they differ
                    answers.append(
                        answers[0]
                        if both == total
                        else decoded(model, tokenizer, prompt, served, sample.max_new_tokens)
                    )
                    cell = cells.setdefault(
                        (method, fraction, own),
                        {
                            "prompts": 0,
                            "kept": 0,
                            "both": 0,
                            "answers_differ": 0,
                            "score_f32": 0.0,
                            "score_bf16": 0.0,
                        },
                    )
                    cell["prompts"] += 1
                    cell["kept"] += total
                    cell["both"] += both
                    cell["answers_differ"] += int(answers[0] != answers[1])
                    cell["score_f32"] += score(answers[0], sample.answers, sample.metric)
                    cell["score_bf16"] += score(answers[1], sample.answers, sample.metric)
                    print(
                        f"{sample.id} {method}@{fraction} own={own or 'all'}: {both / total:.4f} kept alike, "
                        f"answers {'differ' if answers[0] != answers[1] else 'same'}",
                        file=sys.stderr,
                    )
    header = ["method", "kept", "chosen from", "prompts", "kept alike", "answers differ", "f32", "bf16"]
    print("| " + " | ".join(header) + " |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for (method, fraction, own), cell in cells.items():
        print(
            f"| {method} | {fraction:g} | {f'last {own}' if own else 'all'} | {cell['prompts']} | "
            f"{cell['both'] / cell['kept']:.4f} | {cell['answers_differ']} | {cell['score_f32']:.1f} | "
            f"{cell['score_bf16']:.1f} |"
        )
    if args.out:
        rows = [{"method": m, "fraction": f, "own_tokens": o, **cell} for (m, f, o), cell in cells.items()]
        Path(args.out).write_text(json.dumps({"settings": vars(args), "cells": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
