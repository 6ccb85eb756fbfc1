"""The question probe against the last window, with the question first and last (HF runner, issue 32).

For each prompt of the chosen tasks (``vllm-kvevict eval`` generator, same seeds as the server runs) and each
kept fraction, with the server's whole-prompt plan (32-token blocks):

- ``full-cache``; ``<method> whole``: the method judged by the prompt's last window (the served default);
- ``<method> probe``: the same method judged by the queries of a side sequence (``hf_reference.probe``): the
  last user turn's first W tokens and the prompt's last W, run alone after the prompt's end; the method's
  window is set to the probe's length (it always keeps that many last tokens);
- ``<method> head+window``: the prompt's own last W queries together with those of the last user turn's
  first W tokens run alone after the prompt (the question's place in a question-first prompt), window 2W;
- ``<method> head-echo+window``: as head+window, but the user turn's first W tokens are run again after the
  prompt with its whole cache in view (an echo), so their queries in every layer have read the document;
- ``h2o whole``: accumulated attention of every prompt query, the question-position-free baseline.

``--variants`` picks the rows (default: all).

Each kept set is decoded greedily (masks, true positions) and scored like ``eval``; prints the mean score per
(variant, fraction, task family), question first against question last.

    .venv/bin/python benchmarks/policy_quality/question_probe.py --lengths 4096 --samples 1 \
        --out benchmarks/policy_quality/results-question-probe-4k.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import decode_in_batches  # noqa: E402
from sweep import decode_limits, run_samples, scored_row, summarise  # noqa: E402

from vllm_kvevict.hf_reference import prefill  # noqa: E402
from vllm_kvevict.hf_reference.probe import (  # noqa: E402
    echo_queries,
    head_tokens,
    probe_queries,
    probe_tokens,
    probed_layers,
)
from vllm_kvevict.layout.accounting import plan_request  # noqa: E402
from vllm_kvevict.policies.base import KeptTokens  # noqa: E402
from vllm_kvevict.policies.registry import build_policy  # noqa: E402

NEEDLES = "niah_single_essay,niah_multikey,niah_single_noise,niah_single_digits"
TASKS = ",".join(f"qfirst_{task}" for task in NEEDLES.split(",")) + "," + NEEDLES
BLOCK_SIZE = 32


VARIANTS = ("full", "whole", "probe", "head-window", "head-echo", "h2o")


def rows_for_prompt(
    model, tokenizer, sample, method: str, fractions, width: int, batch_bytes, chosen=VARIANTS
) -> list[dict]:
    ids = torch.tensor(sample.token_ids)
    n = len(sample.token_ids)
    whole = prefill(model, ids, query_window=None)  # every query: H2O reads them all
    token_ids = list(sample.token_ids)
    probe = probe_tokens(token_ids, tokenizer, width)
    head = head_tokens(token_ids, tokenizer, width)
    num_layers = model.config.num_hidden_layers
    new_tokens, finished = decode_limits(sample, tokenizer)
    runs = []
    if "full" in chosen:
        runs.append(
            ("full-cache", 1.0, [KeptTokens.everything(layer.num_kv_heads, n) for layer in whole.layers])
        )
    variants = []
    if "whole" in chosen:
        variants.append((f"{method} whole", build_policy(method), whole.layers))
    if "probe" in chosen:
        probed = probed_layers(whole.layers, probe_queries(model, probe, n))
        variants.append((f"{method} probe", build_policy(method, window=len(probe)), probed))
    if "head-window" in chosen:
        both = probed_layers(whole.layers, probe_queries(model, head, n), window=width)
        variants.append((f"{method} head+window", build_policy(method, window=width + len(head)), both))
    if "head-echo" in chosen and head:
        echoed = probed_layers(whole.layers, echo_queries(model, whole, head), window=width)
        echo_policy = build_policy(method, window=width + len(head))
        variants.append((f"{method} head-echo+window", echo_policy, echoed))
    if "h2o" in chosen:
        variants.append(("h2o whole", build_policy("h2o"), whole.layers))
    for label, policy, layers in variants:
        for fraction in fractions:
            plan = plan_request(n, fraction, BLOCK_SIZE, policy, num_layers)
            budgets = [min(budget, n) for budget in plan.layer_budgets]
            runs.append(
                (label, fraction, [policy.select(lay, b) for lay, b in zip(layers, budgets, strict=True)])
            )
    rows = []
    for label, fraction, kept in runs:
        (tokens,) = decode_in_batches(
            model, whole, [kept], new_tokens, n, [tokenizer.eos_token_id], finished, batch_bytes
        )
        output = tokenizer.decode(tokens, skip_special_tokens=True)
        rows.append(scored_row(sample, label, fraction, output, probe_tokens=len(probe)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="Question probe vs last window (HF masked runner)")
    parser.add_argument("--method", default="ada-snapkv")
    parser.add_argument("--tasks", default=TASKS)
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--fractions", default="0.25,0.1")
    parser.add_argument("--width", type=int, default=32, help="W: probe tokens at each end of the user turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, required=True, help="JSON lines; prompts already there are skipped"
    )
    parser.add_argument("--batch-bytes", type=float, default=2e9)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"rows to run: {', '.join(VARIANTS)}")
    args = parser.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    variants = args.variants.split(",")
    records = run_samples(
        args,
        lambda model, tokenizer, sample: rows_for_prompt(
            model, tokenizer, sample, args.method, fractions, args.width, args.batch_bytes, variants
        ),
    )
    for family, first in (("question first", True), ("question last", False)):
        chosen = [r for r in records if r["task"].startswith("qfirst_") == first]
        if chosen:
            print(f"\n{family}\n\n{summarise(chosen)}")


if __name__ == "__main__":
    main()
