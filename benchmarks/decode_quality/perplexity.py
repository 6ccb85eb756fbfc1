"""Decode-time eviction quality: log-perplexity over a long text with every KV head capped while the text is
read token by token (teacher-forced), for the full cache and each decode-time method at each cap.

The text is the project's generated essay haystack (``vllm_kvevict.evaluation.haystacks``, kind ``essay``,
a seed), cut to ``--tokens`` tokens of the bundled model's tokenizer. The first token is the prompt; every
later token is "generated": the cache is re-scored on the server's schedule (``--interval``) by exactly the
decode policies the server runs (``vllm_kvevict.policies.decode``), in the HF masked reference
(``vllm_kvevict.hf_reference.decode_eviction``). The full cache is one plain forward. Each cap is one batch
of the methods; results are written after each cap (JSON), with the per-token NLL beside them (.pt).

    nice -n 10 .venv/bin/python benchmarks/decode_quality/perplexity.py \\
        --out docs/results/decode-quality/perplexity.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.evaluation.haystacks import haystack_sentences
from vllm_kvevict.hf_reference import load_reference_model
from vllm_kvevict.hf_reference.decode_eviction import DecodeCap, capped_decode
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy
from vllm_kvevict.policies.method_spec import parse_method_spec
from vllm_kvevict.policies.registry import build_decode_policy, decode_method_names


def essay_tokens(tokenizer: PreTrainedTokenizerBase, num_tokens: int, seed: int) -> torch.Tensor:
    """[num_tokens] token ids of the seeded essay haystack (enough words generated, then cut)."""
    words = num_tokens
    while True:
        text = " ".join(haystack_sentences("essay", seed, words))
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= num_tokens:
            return torch.tensor(ids[:num_tokens], dtype=torch.int64)
        words *= 2


@torch.inference_mode()
def full_cache_nll(model: PreTrainedModel, ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """[n - 1] float64 NLL of ids[1:] with the full cache (one causal forward, in chunks for memory)."""
    cache = DynamicCache(config=model.config)
    nll = []
    for start in range(0, ids.shape[0] - 1, chunk):
        piece = ids[start : min(start + chunk, ids.shape[0] - 1)]
        logits = model(input_ids=piece[None], past_key_values=cache, use_cache=True).logits[0].double()
        targets = ids[start + 1 : start + 1 + piece.shape[0]]
        nll.append(-torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0])
    return torch.cat(nll)


def decode_policy_from_spec(spec: str) -> DecodeEvictionPolicy:
    """``name`` or ``name:param=value,...`` (e.g. ``roco:sinks=4``) -> the decode-time policy; the label is
    the spec. Raises ValueError naming a bad name, parameter or value."""
    name, params = parse_method_spec(spec)
    if name not in decode_method_names():
        raise ValueError(f"{name!r} is not one of {', '.join(decode_method_names())}")
    policy = build_decode_policy(name, **params)
    policy.name = spec
    return policy


def summary(nll: torch.Tensor) -> dict[str, float]:
    mean = float(nll.mean())
    return {"log_ppl": mean, "ppl": math.exp(mean), "tokens_scored": int(nll.shape[0])}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="results JSON (the .pt of NLLs goes beside it)"
    )
    parser.add_argument("--tokens", type=int, default=6144)
    parser.add_argument("--seed", type=int, default=0, help="essay haystack seed")
    parser.add_argument("--caps", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["streamingllm", "h2o", "roco", "snapkv"],
        help="decode methods, each NAME or NAME:param=value,... (e.g. roco:sinks=4)",
    )
    parser.add_argument(
        "--pooled",
        nargs="*",
        default=[],
        help="decode methods (specs as --methods) also run with every layer's held entries ranked together "
        "(L x H x cap kept: the server's budget_scope 'model'); a stateless method that reads values (kvzap)",
    )
    parser.add_argument("--interval", type=int, default=16, help="generated tokens between re-scores")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--ada-alpha",
        type=float,
        default=None,
        help="Ada-style ragged caps across the heads of a layer (summing to heads x cap) with this safeguard",
    )
    args = parser.parse_args()
    try:
        policies = {spec: decode_policy_from_spec(spec) for spec in [*args.methods, *args.pooled]}
    except ValueError as error:
        parser.error(f"--methods/--pooled: {error}")
    rows = [(spec, False) for spec in args.methods] + [(spec, True) for spec in args.pooled]
    torch.set_num_threads(args.threads)
    model, tokenizer = load_reference_model(prepared_model_dir())
    ids = essay_tokens(tokenizer, args.tokens, args.seed)
    results: dict = {
        "text": f"essay haystack, seed {args.seed}, first {args.tokens} tokens of the model's tokenizer",
        "interval": args.interval,
        "prompt_tokens": 1,
        "dtype": "float32",
        "machine": f"{platform.processor() or platform.machine()}, torch threads {args.threads}",
        "rows": [],
    }
    nlls: dict[str, torch.Tensor] = {}
    started = time.time()
    nlls["full"] = full_cache_nll(model, ids)
    results["rows"].append({"label": "full", "method": "full", "cap": None, **summary(nlls["full"])})
    print(f"full: {results['rows'][-1]} ({time.time() - started:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for cap in args.caps:
        configs = [
            DecodeCap(policies[spec], cap, ada_alpha=args.ada_alpha, pooled=pooled) for spec, pooled in rows
        ]
        t0 = time.time()

        def progress(done: int, t0: float = t0, cap: int = cap) -> None:
            if done % 512 < args.interval:
                print(f"  cap {cap}: {done}/{args.tokens - 1} tokens, {time.time() - t0:.0f} s", flush=True)

        run = capped_decode(
            model,
            ids[:1],
            configs,
            steps=args.tokens - 1,
            interval=args.interval,
            forced=ids[1:],
            progress=progress,
        )
        for index, ((name, pooled), label) in enumerate(zip(rows, run.labels, strict=True)):
            nlls[label] = run.nll[index]
            row = {"label": label, "method": name, "cap": cap, "pooled": pooled, **summary(run.nll[index])}
            row["max_held_per_head"] = int(run.max_held[index])
            row["seconds"] = round(time.time() - t0, 1)
            results["rows"].append(row)
            print(row, flush=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        torch.save(nlls, args.out.with_suffix(".pt"))
    results["seconds"] = round(time.time() - started, 1)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
