"""Per-chunk eviction against whole-prompt eviction, on the eval suite's own prompts (HF masked runner).

For each prompt of the chosen ``vllm-kvevict eval`` tasks (same generator and seeds as the server runs) and
each (method, kept fraction), both with the server's plan (``layout.accounting``: block-aligned budgets,
32-token blocks, the layer budgets of the method):

- ``whole``: one full prefill, then every layer keeps its layer budget (what the server does with
  ``prefill: whole``);
- ``chunked@I``: the prompt is prefilled in ``--chunk`` token chunks with ``hf_reference.chunked_prefill`` —
  after each chunk whose rule evicts, every layer keeps a(n) entries per head (``between_chunks``), the last
  chunk keeps the layer budgets — with the intermediate budget ``chunk_budget = I`` (a multiple of B');
  ``--chunk-budgets none`` runs no such row;
- ``chunked tw=W``: FastKVzip's rule instead of I (``--trailing-windows``; the server's ``trailing_window``,
  ``RequestPlan.trailing_held``): the tokens before the prompt's last W are held at r' = (B' - W) / (L - W),
  the arrived part of the last W whole.
- with ``--echo W`` (the question echo, ``datapath/question_echo.py``), three more rows per method and
  fraction (the per-chunk ones for every intermediate budget and trailing window): ``whole echo`` (the
  served default: the last user turn's first W tokens run after the prompt, their queries judging beside
  the method's own window), ``chunked@I echo-last`` (per chunk, the echo
  judging the last chunk's selection only: the server with ``prefill: chunked``) and ``chunked@I echo``
  (the echo after every evicting chunk too: there the user turn's first W tokens and the prompt's last W,
  run right after the tokens so far, since a question-last prompt's question has not arrived yet).

Methods that read every prompt query (Expected Attention, H2O) get them all in the whole-prompt prefill;
per chunk, Expected Attention's query statistics are carried across chunks.

Each kept set is decoded greedily (masks, true positions) and scored like ``eval``. Prints a markdown table:
mean score over prompts per (variant, fraction, length).

    .venv/bin/python benchmarks/policy_quality/chunked_vs_whole.py --lengths 1024 --samples 2 \
        --out /tmp/chunked.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import decode_in_batches  # noqa: E402
from sweep import (  # noqa: E402
    QUERY_WINDOW,
    decode_limits,
    run_samples,
    scored_row,
    summarise,
)

from vllm_kvevict.datapath.question_echo import echo_policy  # noqa: E402
from vllm_kvevict.hf_reference import prefill  # noqa: E402
from vllm_kvevict.hf_reference.chunked import chunked_prefill  # noqa: E402
from vllm_kvevict.hf_reference.probe import (  # noqa: E402
    echo_queries,
    head_tokens,
    probe_tokens,
    probed_layers,
)
from vllm_kvevict.layout.accounting import plan_request, with_chunk_budget  # noqa: E402
from vllm_kvevict.policies.base import KeptTokens  # noqa: E402
from vllm_kvevict.policies.between_chunks import (  # noqa: E402
    BETWEEN_KINDS,
    BETWEEN_SCORERS,
    DEFAULT_BETWEEN,
    BetweenRule,
    trailing_floor,
)
from vllm_kvevict.policies.registry import build_policy  # noqa: E402
from vllm_kvevict.settings.parsers import parse_chunk_budget  # noqa: E402

TASKS = (
    "fwe,niah_multikey,niah_multikey_hard,niah_multiquery,niah_multivalue,niah_single_digits,"
    "niah_single_essay,niah_single_noise,vt"
)
BLOCK_SIZE = 32
#: the echo's rows: whole-prompt, per chunk at the last chunk only, per chunk after every evicting chunk
ECHO_ROWS = ("whole", "last", "each")


def variant_suffix(rule: BetweenRule) -> str:
    """The row label's tail: the kind, and the share/span where they are not the defaults."""
    if rule.kind == "window":
        return ""
    default = BetweenRule(rule.kind)
    share = f" share={rule.share:g}" if rule.kind == "blend" and rule.share != default.share else ""
    span = f" span={rule.span_after}" if rule.span_after != default.span_after else ""
    scorer = f" {rule.scorer}" if rule.kind == "blend" and rule.scorer != default.scorer else ""
    return f" {rule.kind}{share}{span}{scorer}"


def rows_for_prompt(
    model,
    tokenizer,
    sample,
    methods,
    fractions,
    chunk_budgets,
    chunk: int,
    batch_bytes,
    betweens,
    references: bool = True,
    trailing_windows=(),
    echo: int = 0,
    echo_rows=ECHO_ROWS,
    plain_chunked: bool = True,
):
    """Every (variant, fraction) row of one prompt, decoded and scored; ``references``: with the full-cache
    and whole-prompt rows (they depend on neither the chunk budget nor the between rule); ``echo_rows``:
    which echo rows (``ECHO_ROWS``) when ``echo`` > 0; ``plain_chunked``: with the per-chunk rows without
    an echo."""
    ids = torch.tensor(sample.token_ids)
    n = len(sample.token_ids)
    needs_all = any(build_policy(method).query_window(n) > QUERY_WINDOW for method in methods)
    window = None if needs_all else QUERY_WINDOW  # None: every query (Expected Attention, H2O)
    whole = prefill(model, ids, query_window=window) if references else None
    num_layers = model.config.num_hidden_layers
    new_tokens, finished = decode_limits(sample, tokenizer)
    stops = [tokenizer.eos_token_id]
    runs = []
    head = head_tokens(sample.token_ids, tokenizer, echo) if echo else []
    between_echo = probe_tokens(sample.token_ids, tokenizer, echo) if echo else []
    if whole is not None:
        everything = [KeptTokens.everything(layer.num_kv_heads, n) for layer in whole.layers]
        runs.append(("full-cache", 1.0, whole, everything))
    for method in methods:
        policy = build_policy(method)
        for fraction in fractions:
            plan = plan_request(n, fraction, BLOCK_SIZE, policy, num_layers)
            if whole is not None:
                budgets = [min(budget, n) for budget in plan.layer_budgets]
                kept = [policy.select(layer, b) for layer, b in zip(whole.layers, budgets, strict=True)]
                runs.append((f"{method} whole", fraction, whole, kept))
                if head and "whole" in echo_rows:
                    echoed = echo_policy(policy, len(head))
                    window = policy.query_window(n)
                    layers = probed_layers(whole.layers, echo_queries(model, whole, head), window=window)
                    kept = [echoed.select(layer, b) for layer, b in zip(layers, budgets, strict=True)]
                    runs.append((f"{method} whole echo", fraction, whole, kept))
            echoes = [("", (), ())] if plain_chunked else []
            if head and "last" in echo_rows:
                echoes.append((" echo-last", head, ()))
            if head and "each" in echo_rows:
                echoes.append((" echo", head, between_echo))
            for between in betweens:
                floor = trailing_floor(policy, between)
                chunk_plans = [
                    (f"chunked@{factor:g}", with_chunk_budget(plan, factor)) for factor in chunk_budgets
                ]
                chunk_plans += [
                    (f"chunked tw={w}", with_chunk_budget(plan, 1.0, 0, w, floor)) for w in trailing_windows
                ]
                for name, chunk_plan in chunk_plans:
                    label = f"{method} {name}" + variant_suffix(between)
                    for suffix, last, each in echoes:
                        chunked = chunked_prefill(
                            model, ids, policy, chunk_plan, chunk, between, echo=last, between_echo=each
                        )
                        runs.append((label + suffix, fraction, chunked.prompt, chunked.kept))
    rows = []
    for label, fraction, prompt, kept in runs:
        (tokens,) = decode_in_batches(model, prompt, [kept], new_tokens, n, stops, finished, batch_bytes)
        output = tokenizer.decode(tokens, skip_special_tokens=True)
        rows.append(scored_row(sample, label, fraction, output))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="Per-chunk vs whole-prompt eviction (HF masked runner)")
    parser.add_argument("--methods", default="snapkv,ada-snapkv")
    parser.add_argument("--tasks", default=TASKS)
    parser.add_argument("--lengths", default="1024")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--fractions", default="0.25,0.1")
    parser.add_argument(
        "--chunk-budgets",
        default="1.5",
        help="intermediate budgets I: multiples of B' (1.5) or tokens per KV head (768); none: no such row",
    )
    parser.add_argument(
        "--trailing-windows",
        default="",
        help="comma list of W: per-chunk rows with FastKVzip's trailing-window rule (none by default)",
    )
    parser.add_argument(
        "--between",
        default=DEFAULT_BETWEEN,
        help=f"how held entries are judged between chunks, comma-separated: {', '.join(BETWEEN_KINDS)}",
    )
    parser.add_argument("--between-share", type=float, default=BetweenRule.share, help="blend: method share")
    parser.add_argument("--between-span", type=int, default=BetweenRule.span_after, help="key score span")
    parser.add_argument(
        "--between-scorer",
        default=BetweenRule.scorer,
        help=f"blend's second score: {', '.join(BETWEEN_SCORERS)}",
    )
    parser.add_argument(
        "--echo", type=int, default=0, help="W > 0: the question echo's rows (whole, per chunk)"
    )
    parser.add_argument(
        "--echo-rows", default=",".join(ECHO_ROWS), help=f"with --echo: which of {', '.join(ECHO_ROWS)}"
    )
    parser.add_argument("--no-plain-chunked", action="store_true", help="no per-chunk rows without the echo")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk size (max_num_batched_tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, required=True, help="JSON lines; prompts already there are skipped"
    )
    parser.add_argument("--batch-bytes", type=float, default=2e9)
    parser.add_argument(
        "--no-references",
        action="store_true",
        help="per-chunk rows only (full-cache and whole rows come from an earlier run's file)",
    )
    parser.add_argument("--summary-only", action="store_true")
    args = parser.parse_args()
    if args.summary_only:
        records = (
            [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
        )
    else:
        betweens = [
            BetweenRule(k, args.between_share, args.between_span, scorer)
            for k in args.between.split(",")
            for scorer in args.between_scorer.split(",")
        ]
        records = run_samples(
            args,
            lambda model, tokenizer, sample: rows_for_prompt(
                model,
                tokenizer,
                sample,
                args.methods.split(","),
                [float(f) for f in args.fractions.split(",")],
                [parse_chunk_budget(c) for c in args.chunk_budgets.split(",") if c not in ("", "none")],
                args.chunk,
                args.batch_bytes,
                betweens,
                references=not args.no_references,
                trailing_windows=[int(w) for w in args.trailing_windows.split(",") if w],
                echo=args.echo,
                echo_rows=args.echo_rows.split(","),
                plain_chunked=not args.no_plain_chunked,
            ),
        )
    print(summarise(records))


if __name__ == "__main__":
    main()
