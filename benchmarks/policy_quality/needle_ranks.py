"""Where a needle's answer tokens rank in each KV head, by KVzip+, the learned scorer and the served default.

An answer decoded from an evicted cache needs its needle's value tokens kept. For each prompt of the needle
tasks this finds the answer's tokens in the prompt and, per (layer, KV head), the share of the prompt's
tokens that score strictly above each of them ("rank share": below 0.25 means a per-head top quarter holds
it). Scores: ``kvzip+`` (``hf_reference.kvzip``, the learned scorer's target), ``kvzap`` (the scorer in
``--scorer``, its predicted log KVzip+ score) and ``ada-snapkv echo`` (the served default's SnapKV scores with
the question echo). Also the learned scorer's fit at this length: the share of KVzip+'s per-head top quarter
(context tokens only) that its own top quarter holds, averaged over (layer, head).

Per prompt one JSON line per method (``median_rank``, ``in_top_quarter``/``in_top_tenth``: the share of
(layer, head, answer token) triples inside that share, ``heads_hold_all_quarter``: the share of (layer, head)
pairs whose top quarter holds every answer token) and a printed table of the means over prompts.

    .venv/bin/python benchmarks/policy_quality/needle_ranks.py --lengths 4096 --samples 1 \\
        --out docs/results/2026-12-06-needle-ranks/ranks-4k.jsonl
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep import QUERY_WINDOW, run_samples  # noqa: E402

from vllm_kvevict.calibration.metrics import top_overlap  # noqa: E402
from vllm_kvevict.datapath.chat_marks import chat_marks  # noqa: E402
from vllm_kvevict.datapath.question_echo import user_turn_start  # noqa: E402
from vllm_kvevict.hf_reference import prefill  # noqa: E402
from vllm_kvevict.hf_reference.kvzip import kvzip_scores  # noqa: E402
from vllm_kvevict.hf_reference.probe import echo_queries, head_tokens, probed_layers  # noqa: E402
from vllm_kvevict.policies.registry import build_policy  # noqa: E402
from vllm_kvevict.settings.config import DEFAULT_ECHO_WIDTH  # noqa: E402

NEEDLE_TASKS = (
    "niah_single_noise,niah_single_essay,niah_single_digits,niah_multikey,"
    "qfirst_niah_single_noise,qfirst_niah_single_essay,qfirst_niah_single_digits,qfirst_niah_multikey"
)
SCORER = "vllm_kvevict/scorers/smollm2-135m-instruct-mlp"


def answer_positions(token_ids: list[int], answers: list[str], tokenizer) -> list[int]:
    """Prompt positions of the first answer whose tokens (with or without a leading space) occur in it."""
    for answer in answers:
        for text in (" " + answer, answer):
            needle = tokenizer.encode(text, add_special_tokens=False)
            for start in range(len(token_ids) - len(needle) + 1):
                if token_ids[start : start + len(needle)] == needle:
                    return list(range(start, start + len(needle)))
    return []


def rank_shares(scores: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """[heads, P] share of the n tokens scoring strictly above each of ``positions``; scores [heads, n]."""
    finite = torch.nan_to_num(scores.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    above = finite.unsqueeze(-1) > finite[:, positions].unsqueeze(1)  # [heads, n, P]
    return above.sum(dim=1).float() / scores.shape[-1]


def top_quarter_overlap(predicted: torch.Tensor, target: torch.Tensor, start: int) -> float:
    """Mean over heads of the share of ``target``'s top quarter of tokens [start, n) that ``predicted``'s
    top quarter holds; predicted, target: [heads, n]. The calibration's held-out measure (``top_overlap``)."""
    return float(top_overlap(predicted[:, start:].float().T, target[:, start:].float().T).mean())


def rows_for_prompt(model, tokenizer, sample, scorer: str) -> list[dict]:
    """One row per method for ``sample`` (see the module docstring)."""
    ids = list(sample.token_ids)
    n = len(ids)
    positions = answer_positions(ids, list(sample.answers), tokenizer)
    if not positions:
        print(f"{sample.id}: answer not in the prompt, skipped", flush=True)
        return []
    prompt = torch.tensor(ids)
    whole = prefill(model, prompt, query_window=QUERY_WINDOW)
    start = user_turn_start(ids, chat_marks(tokenizer).user_header) or 0
    target = kvzip_scores(model, tokenizer, prompt, context_start=start, plus=True).scores
    learned = build_policy("kvzap", scorer=scorer)
    default = build_policy("ada-snapkv").inner
    head = head_tokens(ids, tokenizer, DEFAULT_ECHO_WIDTH)
    echoed = (
        probed_layers(whole.layers, echo_queries(model, whole, head), window=default.query_window(n))
        if head
        else whole.layers
    )
    per_method = {
        "kvzip+": [target[layer.layer_idx, :, :n].float() for layer in whole.layers],
        "kvzap": [learned.entry_scores(layer) for layer in whole.layers],
        "ada-snapkv echo": [default.score(layer, n // 4) for layer in echoed],
    }
    pairs = zip(per_method["kvzap"], per_method["kvzip+"], strict=True)
    overlap = sum(top_quarter_overlap(p, t, start) for p, t in pairs) / len(whole.layers)
    rows = []
    for method, scores in per_method.items():
        shares = torch.stack([rank_shares(s, positions) for s in scores])  # [layers, heads, P]
        rows.append(
            {
                "sample": sample.id,
                "task": sample.task,
                "length": sample.target_tokens,
                "method": method,
                "answer_at": positions[0],
                "num_tokens": n,
                "median_rank": float(shares.median()),
                "in_top_quarter": float((shares < 0.25).float().mean()),
                "in_top_tenth": float((shares < 0.10).float().mean()),
                "heads_hold_all_quarter": float((shares < 0.25).all(dim=-1).float().mean()),
                "kvzap_top_quarter_overlap": overlap,
            }
        )
    return rows


def summarise(records: list[dict]) -> str:
    """Markdown table: each method's means over the prompts, question last and first apart."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in records:
        placement = "first" if row["task"].startswith("qfirst_") else "last"
        groups[(placement, row["method"])].append(row)
    keys = ("median_rank", "in_top_quarter", "in_top_tenth", "heads_hold_all_quarter")
    lines = [
        "| question | method | prompts | " + " | ".join(keys) + " |",
        "|---|---|---:|" + "---:|" * len(keys),
    ]
    for (placement, method), rows in sorted(groups.items()):
        means = [sum(r[k] for r in rows) / len(rows) for k in keys]
        cells = " | ".join(f"{m:.3f}" for m in means)
        lines.append(f"| {placement} | {method} | {len(rows)} | {cells} |")
    overlaps = [r["kvzap_top_quarter_overlap"] for r in records if r["method"] == "kvzap"]
    if overlaps:
        mean = sum(overlaps) / len(overlaps)
        lines.append(f"\nkvzap's top quarter holds {mean:.3f} of KVzip+'s (mean over prompts)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="answer tokens' per-head ranks: KVzip+, kvzap, the default")
    parser.add_argument("--tasks", default=NEEDLE_TASKS)
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scorer", default=SCORER, help="scorer directory `calibrate` wrote")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines; prompts there are skipped")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = run_samples(
        args,
        lambda model, tokenizer, sample: rows_for_prompt(model, tokenizer, sample, args.scorer),
        describe=lambda r: f"{r['method']}: median rank {r['median_rank']:.3f}",
    )
    print(summarise(records))


if __name__ == "__main__":
    main()
