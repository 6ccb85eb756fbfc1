"""Why a method keeps or loses the needle: per (layer, KV head), does the kept set hold every token of the
needle's value? Compares methods on the needle prompts of ``run.py`` (question-aware) without decoding.

For each prompt and kept fraction it prints, per method: the (layer, head) pairs holding all value tokens,
those holding some, how many of the ``--top`` retrieval heads (the pairs whose observation window puts the
most attention on the value tokens, full cache) hold all of it, and the spread of per-head budgets
(min / max of B_h over all layers and heads).

    .venv/bin/python benchmarks/policy_quality/needle_coverage.py --lengths 1024,2048 --samples 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from needle import needle_prompt  # noqa: E402

from vllm_kvevict.hf_reference import kept_per_layer, kvpress_kept_count, load_reference_model, prefill  # noqa: E402
from vllm_kvevict.policies.attention_scores import group_mean, window_attention  # noqa: E402
from vllm_kvevict.policies.base import KeptTokens  # noqa: E402
from vllm_kvevict.policies.registry import build_policy  # noqa: E402


def value_positions(tokenizer, input_ids: list[int], answer: str) -> list[int]:
    """Positions of the tokens that spell ``answer`` (its single occurrence in the prompt)."""
    pieces = [tokenizer.decode([token]) for token in input_ids]
    for start in range(len(pieces)):
        text, end = "", start
        while end < len(pieces) and len(text.strip()) < len(answer):
            text += pieces[end]
            end += 1
        if text.strip() == answer:
            return list(range(start, end))
    raise ValueError(f"answer {answer!r} not found in the prompt")


def value_attention(layers, positions: list[int]) -> list[list[float]]:
    """[layer, head, attention] of every (layer, KV head) pair: its window attention summed over
    ``positions`` (GQA mean)."""
    mass = []
    for layer_idx, layer in enumerate(layers):
        scores = group_mean(window_attention(layer.queries, layer.keys), layer.num_kv_heads)  # [kv_heads, n]
        for head, value in enumerate(scores[:, positions].sum(dim=1).tolist()):
            mass.append([layer_idx, head, value])
    return mass


def top_pairs(mass: list[list[float]], top: int) -> set[tuple[int, int]]:
    """The ``top`` (layer, KV head) pairs of ``value_attention``'s rows with the most attention."""
    ranked = sorted(((value, int(layer), int(head)) for layer, head, value in mass), reverse=True)
    return {(layer, head) for _, layer, head in ranked[:top]}


def retrieval_heads(layers, positions: list[int], top: int) -> set[tuple[int, int]]:
    """The ``top`` (layer, KV head) pairs with the most window attention on ``positions`` (GQA mean)."""
    return top_pairs(value_attention(layers, positions), top)


def coverage(
    kept: list[KeptTokens], positions: list[int], heads: set[tuple[int, int]]
) -> tuple[int, int, int, int, int]:
    """(pairs holding every value token, pairs holding some, ``heads`` holding every value token,
    min B_h, max B_h) over layers and KV heads."""
    wanted = torch.tensor(positions)
    full = some = retrieval = 0
    for layer_idx, layer in enumerate(kept):
        for h in range(layer.counts.numel()):
            held = torch.isin(wanted, layer.head(h)).sum().item()
            full += held == len(positions)
            some += 0 < held < len(positions)
            retrieval += held == len(positions) and (layer_idx, h) in heads
    counts = torch.cat([layer.counts for layer in kept])
    return full, some, retrieval, int(counts.min()), int(counts.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--fractions", default="0.5,0.25,0.1")
    parser.add_argument("--methods", default="snapkv,ada-snapkv")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=10, help="retrieval heads to follow")
    args = parser.parse_args()
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    model, tokenizer = load_reference_model(prepared_model_dir())
    methods = args.methods.split(",")
    fractions = [float(f) for f in args.fractions.split(",")]
    header = f"{{}}: all / some digits, top-{args.top} with all, B_h range"
    print("| prompt | kept | " + " | ".join(header.format(m) for m in methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for length in map(int, args.lengths.split(",")):
        for sample_idx in range(args.samples):
            sample = needle_prompt(tokenizer, length, sample_idx, args.seed)
            positions = value_positions(tokenizer, sample.input_ids, sample.answer)
            prompt = prefill(model, torch.tensor(sample.input_ids), query_window=32)
            n = prompt.num_tokens
            pairs = len(prompt.layers) * prompt.layers[0].num_kv_heads
            heads = retrieval_heads(prompt.layers, positions, args.top)
            for fraction in fractions:
                cells = []
                budget = kvpress_kept_count(n, fraction)
                for method in methods:
                    kept = kept_per_layer(build_policy(method), prompt.layers, budget)
                    full, some, retrieval, low, high = coverage(kept, positions, heads)
                    cells.append(f"{full} / {some} of {pairs}, {retrieval}/{len(heads)}, {low}–{high}")
                name = f"{length // 1024}k #{sample_idx} (depth {sample.needle_depth:.2f})"
                print(f"| {name} | {fraction:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
