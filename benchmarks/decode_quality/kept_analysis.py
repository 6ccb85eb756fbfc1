"""Which entries each decode-time method keeps, per layer: why one method beats another on a text.

Runs the capped teacher-forced decode of ``perplexity.py`` on the first ``--tokens`` tokens of the same
text for the methods at one cap (plus RoCo without its std-dev scope), then reports per method the mean
log-perplexity and, at the end of the text, per layer: the mean age of the kept entries (current position
minus theirs), the share of kept entries among the newest ``cap`` positions (what StreamingLLM keeps), and
the share of heads that still hold position 0 (the attention sink).

    nice -n 10 .venv/bin/python benchmarks/decode_quality/kept_analysis.py --tokens 1024 --cap 256 \\
        --out docs/results/decode-quality/kept_analysis.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from perplexity import essay_tokens  # noqa: E402

from vllm_kvevict.cli.prepare_model import prepared_model_dir  # noqa: E402
from vllm_kvevict.hf_reference import load_reference_model  # noqa: E402
from vllm_kvevict.hf_reference.decode_eviction import DecodeCap, capped_decode  # noqa: E402
from vllm_kvevict.policies.registry import build_decode_policy  # noqa: E402


def kept_profile(held: torch.Tensor, layers: int, end: int, cap: int) -> dict[str, list[float]]:
    """Per layer statistics of the positions ``held`` [layers * kv_heads, L] (-1 padded) at position
    ``end`` (the newest position written)."""
    held = held.reshape(layers, -1, held.shape[-1])
    valid = held >= 0
    count = valid.sum(dim=(1, 2)).clamp(min=1).double()
    age = torch.where(valid, end - held, 0).sum(dim=(1, 2)).double() / count
    recent = (valid & (held > end - cap)).sum(dim=(1, 2)).double() / count
    sink = (held == 0).any(dim=2).double().mean(dim=1)
    return {"mean_age": age.tolist(), "share_recent": recent.tolist(), "heads_with_sink": sink.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cap", type=int, default=256)
    parser.add_argument("--interval", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_reference_model(prepared_model_dir())
    ids = essay_tokens(tokenizer, args.tokens, args.seed)
    variants = {
        "streamingllm": build_decode_policy("streamingllm"),
        "h2o": build_decode_policy("h2o"),
        "roco": build_decode_policy("roco"),
        "roco std_ratio=0": build_decode_policy("roco", std_ratio=0.0),
        "snapkv": build_decode_policy("snapkv"),
    }
    for label, policy in variants.items():
        policy.name = label
    configs = [DecodeCap(None)] + [DecodeCap(policy, args.cap) for policy in variants.values()]
    started = time.time()
    run = capped_decode(
        model, ids[:1], configs, steps=args.tokens - 1, interval=args.interval, forced=ids[1:]
    )
    layers = model.config.num_hidden_layers
    end = args.tokens - 2  # the last position written to the cache
    results = {
        "text": f"essay haystack, seed {args.seed}, first {args.tokens} tokens",
        "cap": args.cap,
        "interval": args.interval,
        "seconds": round(time.time() - started, 1),
        "rows": {},
    }
    for index, label in enumerate(run.labels):
        row = {"log_ppl": float(run.nll[index].mean())}
        if index > 0:
            row.update(kept_profile(run.held[index], layers, end, args.cap))
        results["rows"][label] = row
        summary = {
            k: (round(sum(v) / len(v), 3) if isinstance(v, list) else round(v, 4)) for k, v in row.items()
        }
        print(label, summary, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
