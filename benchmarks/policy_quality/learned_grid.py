"""Issue 53's grid in the HF masked runner: question-agnostic eviction by KVzip and by the learned scorer,
whole and per chunk, beside the served default and the full cache, on the eval suite's own prompts.

Per prompt (same generator and seeds as ``vllm-kvevict eval``), each kept fraction planned as the server
plans it (``layout.accounting``, 32-token blocks):

- ``full-cache``;
- ``ada-snapkv whole echo``: the served default (Ada-SnapKV with the question echo of the last user turn's
  first 32 tokens, whole-prompt eviction);
- ``kvzip+ whole`` / ``ada-kvzip+ whole``: KVzip+ scores (``hf_reference.kvzip``: a second pass that
  reconstructs the user turn's content; the chat template's tokens before it are always kept) ranked per
  head with the plan's budgets, uniform or head-wise (Ada-KV) - the targets the learned scorer is fitted to;
- per scorer directory (``--scorers label=DIR``): ``kvzap <label> whole``, ``ada-kvzap <label> whole``, and
  per chunk (``chunked``: the prompt prefilled in ``--chunk``-token chunks with the server's per-chunk rule,
  intermediate budget ``--chunk-budget``, the default ``between`` rule), and, for each ``--thresholds`` tau,
  ``kvzap <label> tau=<tau>`` (whole; the kept count set by the scores, its realised share of the prompt
  in the row's ``kept_share``; listed under fraction 1.0);
- with ``--global-rows``: ``kvzip+ global`` and ``kvzap <label> global``, the same scores ranked across all
  layers and heads at once (kvpress's KVzip default, ``layerwise=False``), as many entries in all as the
  per-layer plan keeps. The server cannot hold such a kept set in fewer blocks than its largest layer's
  (``largest_layer_share``); the rows say what a per-layer block budget would buy;
- with ``--global-rows --keep-question-rows``: ``<global row> keep-q``, the same ranking with the echo's
  question spans (``question_echo.question_spans``: the user turn's first 32 tokens, an own system message's
  last 32) always kept in every layer and head;
- with ``--global-rows --echo-half-rows``: ``<global row> echo-half``, each head's top ``fraction / 2`` of the
  prompt by the served default's scores under the question echo kept in every layer, the rest of the total
  ranked across layers by the row's scores (half the budget question-aware);
- with ``--level-rows``: ``ada-kvzap <label> levels``, a cross-layer allocation fixed before the prompt: each
  layer's budget is what one threshold would keep if the layer's predicted scores were normal with the
  scorer's calibration levels (``score_levels``), the plan's total in all, Ada-KV across heads within the
  layer. Unlike the global rows it needs no other layer's scores, so a server could apply it layer by layer.

``--only REGEX`` computes and decodes only the variants whose label matches (another run's rows of the same
prompts can live in another ``--out`` file).

Each kept set is decoded greedily (masks, true positions) and scored like ``eval``; rows go to a JSON-lines
file (a prompt already there is skipped) and a markdown table of mean scores is printed.

    .venv/bin/python benchmarks/policy_quality/learned_grid.py --lengths 4096 --samples 1 \
        --scorers linear=vllm_kvevict/scorers/smollm2-135m-instruct-linear \
        --out docs/results/2026-11-29-learned-grid/grid-4k.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chunked_vs_whole import BLOCK_SIZE, TASKS  # noqa: E402
from run import decode_in_batches  # noqa: E402
from sweep import QUERY_WINDOW, decode_limits, run_samples, scored_row, summarise  # noqa: E402

from vllm_kvevict.datapath.chat_marks import chat_marks  # noqa: E402
from vllm_kvevict.datapath.question_echo import echo_policy, question_spans, user_turn_start  # noqa: E402
from vllm_kvevict.hf_reference import kept_ranked_across_layers, prefill  # noqa: E402
from vllm_kvevict.hf_reference.chunked import chunked_prefill  # noqa: E402
from vllm_kvevict.hf_reference.kvzip import KVzipPolicy, kvzip_scores  # noqa: E402
from vllm_kvevict.hf_reference.probe import echo_queries, head_tokens, probed_layers  # noqa: E402
from vllm_kvevict.layout.accounting import plan_request, with_chunk_budget  # noqa: E402
from vllm_kvevict.policies.adakv import AdaKV  # noqa: E402
from vllm_kvevict.policies.base import KeptTokens, LayerKV, ScoredPolicy  # noqa: E402
from vllm_kvevict.policies.between_chunks import DEFAULT_BETWEEN  # noqa: E402
from vllm_kvevict.policies.registry import build_policy  # noqa: E402
from vllm_kvevict.policies.served_scorer import load_scorer  # noqa: E402
from vllm_kvevict.settings.config import DEFAULT_CHUNK_BUDGET, DEFAULT_ECHO_WIDTH  # noqa: E402
from vllm_kvevict.settings.parsers import parse_chunk_budget  # noqa: E402


@dataclass(frozen=True)
class SpansKept:
    """``policy``'s scores with the tokens of ``spans`` (``[start, end)``) always kept (scored +inf)."""

    policy: ScoredPolicy
    spans: tuple[tuple[int, int], ...]

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        scores = self.policy.score(layer, budget).float().clone()
        for start, end in self.spans:
            scores[:, start:end] = float("inf")
        return scores


@dataclass(frozen=True)
class EchoKept:
    """``policy``'s scores with each head's top ``share`` of the prompt by ``echo`` (the served default's
    scores under the question echo, over ``echo_layers``) always kept (scored +inf): half a question-aware
    budget, the rest ranked by ``policy``."""

    policy: ScoredPolicy
    echo: ScoredPolicy
    echo_layers: list[LayerKV]
    share: float

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        scores = self.policy.score(layer, budget).float().clone()
        echo = self.echo.score(self.echo_layers[layer.layer_idx], budget).float()
        count = min(layer.num_tokens, math.ceil(self.share * layer.num_tokens))
        scores.scatter_(-1, echo.topk(count, dim=-1).indices, float("inf"))
        return scores


def kept_share(kept: list[KeptTokens], num_tokens: int) -> float:
    """Kept entries over all (layer, head) pairs as a share of the full cache."""
    held = sum(int(layer.counts.sum()) for layer in kept)
    pairs = sum(int(layer.counts.numel()) for layer in kept)
    return held / max(1, pairs * num_tokens)


def largest_layer_share(kept: list[KeptTokens], num_tokens: int) -> float:
    """The largest layer's kept share (its heads' mean): what a request holds in the server, where every layer
    holds the blocks of its largest one (``docs/policies.md``, "PyramidKV's memory in the server")."""
    return max(float(layer.counts.float().mean()) for layer in kept) / max(1, num_tokens)


def level_budgets(levels: dict, budgets: list[int], num_tokens: int, floor: int) -> list[int]:
    """Per-layer budgets (per head) summing to ``budgets``' total, each layer's what one threshold would keep
    if its predicted scores were normal with the scorer's calibration level (``score_levels`` mean and std):
    a cross-layer allocation known before the prompt, each layer in [``floor``, ``num_tokens``]."""
    mean = torch.tensor(levels["mean"], dtype=torch.float64)
    std = torch.tensor(levels["std"], dtype=torch.float64)
    normal = torch.distributions.Normal(0.0, 1.0)
    total = sum(budgets)

    def kept(tau: float) -> torch.Tensor:
        share = 1.0 - normal.cdf((tau - mean) / std)
        return (num_tokens * share).clamp(min=floor, max=num_tokens)

    low, high = float((mean - 10 * std).min()), float((mean + 10 * std).max())
    for _ in range(100):  # kept() falls as tau rises
        tau = (low + high) / 2
        low, high = (tau, high) if kept(tau).sum() > total else (low, tau)
    exact = kept(high)
    rounded = exact.floor().long()
    remainders = exact - rounded
    short = max(0, min(total - int(rounded.sum()), len(budgets)))
    rounded[remainders.argsort(descending=True)[:short]] += 1  # largest remainders, total kept
    return [int(b) for b in rounded.clamp(max=num_tokens)]


def rows_for_prompt(model, tokenizer, sample, args, scorers: dict[str, str]) -> list[dict]:
    """Every row of one prompt (see the module docstring), decoded and scored."""
    ids = torch.tensor(sample.token_ids)
    n = len(sample.token_ids)
    num_layers = model.config.num_hidden_layers
    fractions = [float(f) for f in args.fractions.split(",")]
    whole = prefill(model, ids, query_window=QUERY_WINDOW)
    runs: list[tuple[str, float, object, list[KeptTokens]]] = []
    only = re.compile(args.only)

    def wanted(label: str) -> bool:
        return only.search(label) is not None

    if wanted("full-cache"):
        everything = [KeptTokens.everything(layer.num_kv_heads, n) for layer in whole.layers]
        runs.append(("full-cache", 1.0, whole, everything))

    def layer_budgets(policy, fraction: float) -> list[int]:
        """Each layer's budget in the server's plan for ``fraction`` of the prompt, at most n."""
        plan = plan_request(n, fraction, BLOCK_SIZE, policy, num_layers)
        return [min(budget, n) for budget in plan.layer_budgets]

    def whole_rows(label: str, policy) -> None:
        if not wanted(label):
            return
        for fraction in fractions:
            budgets = layer_budgets(policy, fraction)
            kept = [policy.select(layer, b) for layer, b in zip(whole.layers, budgets, strict=True)]
            runs.append((label, fraction, whole, kept))

    spans = question_spans(sample.token_ids, chat_marks(tokenizer), DEFAULT_ECHO_WIDTH)
    default = build_policy("ada-snapkv")
    head = head_tokens(sample.token_ids, tokenizer, DEFAULT_ECHO_WIDTH)
    echoed = echo_policy(default, len(head)) if head else None
    probed = []
    if echoed is not None and (wanted("ada-snapkv whole echo") or args.echo_half_rows):
        probed = probed_layers(whole.layers, echo_queries(model, whole, head), window=default.query_window(n))

    def global_rows(label: str, policy) -> None:
        variants = [(label, lambda fraction: policy)]
        if args.keep_question_rows:
            variants.append((f"{label} keep-q", lambda fraction: SpansKept(policy, tuple(spans))))
        if args.echo_half_rows and probed:
            variants.append(
                (f"{label} echo-half", lambda fraction: EchoKept(policy, echoed.inner, probed, fraction / 2))
            )
        for name, ranked in variants:
            if not (args.global_rows and wanted(name)):
                continue
            for fraction in fractions:
                budgets = layer_budgets(policy, fraction)
                kept = kept_ranked_across_layers(ranked(fraction), whole.layers, budgets)
                runs.append((name, fraction, whole, kept))

    if probed and wanted("ada-snapkv whole echo"):
        for fraction in fractions:
            budgets = layer_budgets(default, fraction)
            kept = [echoed.select(layer, b) for layer, b in zip(probed, budgets, strict=True)]
            runs.append(("ada-snapkv whole echo", fraction, whole, kept))
    kvzip_labels = ("kvzip+ whole", "ada-kvzip+ whole", "kvzip+ global")
    if not args.no_kvzip and any(wanted(label) for label in kvzip_labels):
        start = user_turn_start(sample.token_ids, chat_marks(tokenizer).user_header) or 0
        scores = kvzip_scores(model, tokenizer, ids, context_start=start, plus=True).scores.clone()
        scores[:, :, :start] = float("inf")  # the template's system turn and user header: always kept
        whole_rows("kvzip+ whole", KVzipPolicy(scores))
        whole_rows("ada-kvzip+ whole", AdaKV(KVzipPolicy(scores)))
        global_rows("kvzip+ global", KVzipPolicy(scores))
    chunk_budget = parse_chunk_budget(args.chunk_budget)
    for label, directory in scorers.items():
        for method in args.learned_methods.split(","):
            policy = build_policy(method, scorer=directory)
            whole_rows(f"{method} {label} whole", policy)
            if method == "kvzap":
                global_rows(f"kvzap {label} global", policy)
            if method == "ada-kvzap" and args.level_rows and wanted(f"ada-kvzap {label} levels"):
                levels = load_scorer(directory).spec.score_levels
                for fraction in fractions:
                    budgets = level_budgets(levels, layer_budgets(policy, fraction), n, policy.min_budget)
                    kept = [policy.select(layer, b) for layer, b in zip(whole.layers, budgets, strict=True)]
                    runs.append((f"ada-kvzap {label} levels", fraction, whole, kept))
            if method not in args.chunked_methods.split(",") or not wanted(f"{method} {label} chunked"):
                continue
            for fraction in fractions:
                plan = with_chunk_budget(
                    plan_request(n, fraction, BLOCK_SIZE, policy, num_layers), chunk_budget
                )
                chunked = chunked_prefill(model, ids, policy, plan, args.chunk, DEFAULT_BETWEEN)
                runs.append((f"{method} {label} chunked", fraction, chunked.prompt, chunked.kept))
        for tau in args.thresholds.split(","):
            if not tau or not wanted(f"kvzap {label} tau={tau}"):
                continue
            policy = build_policy("kvzap", scorer=directory, threshold=float(tau))
            kept = [policy.select(layer, n) for layer in whole.layers]
            runs.append((f"kvzap {label} tau={tau}", 1.0, whole, kept))
    new_tokens, finished = decode_limits(sample, tokenizer)
    rows = []
    for label, fraction, prompt, kept in runs:
        (tokens,) = decode_in_batches(
            model, prompt, [kept], new_tokens, n, [tokenizer.eos_token_id], finished, args.batch_bytes
        )
        output = tokenizer.decode(tokens, skip_special_tokens=True)
        rows.append(
            scored_row(
                sample,
                label,
                fraction,
                output,
                kept_share=kept_share(kept, n),
                largest_layer_share=largest_layer_share(kept, n),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description="KVzip and the learned scorer, whole and per chunk (HF runner)"
    )
    parser.add_argument("--tasks", default=TASKS)
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--fractions", default="0.25,0.1")
    parser.add_argument(
        "--scorers", default="", help="comma list of label=DIR (scorer directories `calibrate` wrote)"
    )
    parser.add_argument("--thresholds", default="", help="comma list of tau for kvzap's threshold rows")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk size (max_num_batched_tokens)")
    parser.add_argument("--chunk-budget", default=str(DEFAULT_CHUNK_BUDGET), help="intermediate budget")
    parser.add_argument("--learned-methods", default="kvzap,ada-kvzap", help="whole rows of these methods")
    parser.add_argument(
        "--chunked-methods", default="kvzap,ada-kvzap", help="per-chunk rows of these methods ('' for none)"
    )
    parser.add_argument("--no-kvzip", action="store_true", help="no KVzip rows (they cost a second pass)")
    parser.add_argument(
        "--global-rows", action="store_true", help="also rank KVzip+ and kvzap across all layers at once"
    )
    parser.add_argument(
        "--keep-question-rows",
        action="store_true",
        help="with --global-rows: also each global row with the echo's question spans always kept",
    )
    parser.add_argument(
        "--echo-half-rows",
        action="store_true",
        help="with --global-rows: also each global row with half the budget (per head, per layer) kept by "
        "the served default's echo scores",
    )
    parser.add_argument(
        "--level-rows",
        action="store_true",
        help="also ada-kvzap with per-layer budgets from the scorer's calibration score levels",
    )
    parser.add_argument("--only", default="", help="regex: only the variants whose label matches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, required=True, help="JSON lines; prompts already there are skipped"
    )
    parser.add_argument("--batch-bytes", type=float, default=2e9)
    parser.add_argument("--by-task", action="store_true", help="tasks weighed equally")
    parser.add_argument("--summary-only", action="store_true")
    args = parser.parse_args()
    scorers = dict(entry.split("=", 1) for entry in args.scorers.split(",") if entry)
    if args.summary_only:
        records = (
            [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
        )
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        records = run_samples(
            args, lambda model, tokenizer, sample: rows_for_prompt(model, tokenizer, sample, args, scorers)
        )
    print(summarise(records, by_task=args.by_task))


if __name__ == "__main__":
    main()
