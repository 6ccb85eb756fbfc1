"""Where the tail of a multi-token answer goes: per digit of the needle's value, which (layer, KV head)
pairs the full-cache decoding reads it from, and whether each method's kept sets still hold it there.

For each prompt (the eval suite's needle tasks, question-aware): the full cache decodes the answer; the
answer is then run teacher-forced after the prompt with its queries captured, so for the step that writes
digit k we know, per (layer, KV head), the attention (GQA mean) on the prompt token holding digit k - the
"copy" attention. The ``--top`` pairs with the most copy attention for digit k are that digit's copy heads.
For every method and kept fraction it prints, per digit position of the value: the share of all pairs that
keep the token, and the share of its copy heads that keep it.

    .venv/bin/python benchmarks/policy_quality/tail_diagnosis.py --lengths 4096 --samples 2 \
        --variants 'snapkv=snapkv;ada=ada-snapkv'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from needle_coverage import value_positions  # noqa: E402
from sweep import parse_variants  # noqa: E402

from vllm_kvevict.evaluation.generate import generate_samples  # noqa: E402
from vllm_kvevict.evaluation.prompt_format import PromptFormat  # noqa: E402
from vllm_kvevict.hf_reference import (  # noqa: E402
    decode_with_kept,
    kept_per_layer,
    kvpress_kept_count,
    load_reference_model,
    prefill,
)
from vllm_kvevict.policies.attention_scores import group_mean, window_attention  # noqa: E402
from vllm_kvevict.policies.base import KeptTokens  # noqa: E402


def copy_attention(
    model, prompt_ids: list[int], answer_ids: list[int], digit_positions: list[int], first: int
) -> torch.Tensor:
    """[digits, layers, kv_heads]: attention of the step that writes digit k on the prompt token of digit k.

    Digit k is answer token ``first + k``; the step writing answer token t is the query at position
    n - 1 + t of prompt + answer."""
    n = len(prompt_ids)
    full = prefill(model, torch.tensor(prompt_ids + answer_ids), query_window=len(answer_ids) + 1)
    steps = []
    for k in range(len(digit_positions)):
        per_layer = []
        for layer in full.layers:
            t = first + k
            query = layer.queries[:, t : t + 1]
            attn = window_attention(query, layer.keys, torch.tensor([n - 1 + t]))
            per_layer.append(group_mean(attn, layer.num_kv_heads)[:, digit_positions[k]])
        steps.append(torch.stack(per_layer))
    return torch.stack(steps)


def kept_at(kept: list[KeptTokens], position: int) -> torch.Tensor:
    """[layers, kv_heads] bool: does the pair keep ``position``."""
    rows = []
    for layer in kept:
        rows.append(torch.tensor([bool((layer.head(h) == position).any()) for h in range(len(layer.counts))]))
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="snapkv=snapkv;ada-snapkv=ada-snapkv")
    parser.add_argument("--tasks", default="niah_single_essay,niah_multikey")
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--fractions", default="0.25,0.1")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    model, tokenizer = load_reference_model(prepared_model_dir())
    fmt = PromptFormat(tokenizer)
    variants = parse_variants(args.variants)
    lengths = [int(x) for x in args.lengths.split(",")]
    for sample in generate_samples(args.tasks.split(","), lengths, args.samples, args.seed, fmt):
        ids = list(sample.token_ids)
        answer = sample.answers[0]
        digits = value_positions(tokenizer, ids, answer)
        prompt = prefill(model, torch.tensor(ids), query_window=256)
        n = prompt.num_tokens
        everything = [KeptTokens.everything(layer.num_kv_heads, n) for layer in prompt.layers]
        tokens, _ = decode_with_kept(model, prompt, everything, 12, stop_token_ids=[tokenizer.eos_token_id])
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        # Answer tokens up to and including the last digit of the value, teacher-forced.
        pieces = [tokenizer.decode([t]) for t in tokens.tolist()]
        first = next(i for i, piece in enumerate(pieces) if piece.strip()[:1].isdigit())
        answer_ids = tokens.tolist()[: first + len(digits)]
        copy = copy_attention(model, ids, answer_ids, digits, first)
        print(f"\n{sample.id}: n={n}, value {answer} at {digits[0]}..{digits[-1]}, full cache: {text!r}")
        top_heads = []
        for k in range(len(digits)):
            flat = copy[k].flatten()
            top = flat.topk(args.top).indices
            top_heads.append(top)
            pairs = ", ".join(
                f"L{int(i) // copy.shape[2]}H{int(i) % copy.shape[2]}:{float(flat[i]):.2f}" for i in top[:5]
            )
            print(f"  digit {k}: copy heads {pairs}")
        for label, policy in variants.items():
            for fraction in [float(x) for x in args.fractions.split(",")]:
                kept = kept_per_layer(policy, prompt.layers, kvpress_kept_count(n, fraction))
                out, _ = decode_with_kept(model, prompt, kept, 12, stop_token_ids=[tokenizer.eos_token_id])
                cells = []
                for k, position in enumerate(digits):
                    holds = kept_at(kept, position).flatten()
                    cells.append(f"{holds.float().mean():.2f}/{holds[top_heads[k]].float().mean():.1f}")
                answer_text = tokenizer.decode(out, skip_special_tokens=True)
                print(f"  {label}@{fraction}: {' '.join(cells)}  -> {answer_text!r}")


if __name__ == "__main__":
    main()
