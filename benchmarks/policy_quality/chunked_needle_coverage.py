"""Does a needle's value survive per-chunk eviction? For each needle prompt of the eval suite (same generator
and seeds as the server runs), the share of (layer, KV head) pairs whose final kept set holds every token
of each answer's value, with whole-prompt eviction and with per-chunk eviction (``hf_reference
.chunked_prefill``, the server's rule and default ``between``), over all pairs and over the ``--top``
retrieval heads of that value (the pairs whose question window puts the most attention on it, full cache).
No decoding: a value lost from the retrieval heads cannot be answered, whatever the decoder does.

    .venv/bin/python benchmarks/policy_quality/chunked_needle_coverage.py --samples 3 --shard 0/2 \
        --out /tmp/coverage.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from needle_coverage import retrieval_heads, value_positions  # noqa: E402

from vllm_kvevict.evaluation.generate import generate_samples  # noqa: E402
from vllm_kvevict.evaluation.prompt_format import PromptFormat  # noqa: E402
from vllm_kvevict.hf_reference import load_reference_model, prefill  # noqa: E402
from vllm_kvevict.hf_reference.chunked import chunked_prefill  # noqa: E402
from vllm_kvevict.layout.accounting import plan_request, with_chunk_budget  # noqa: E402
from vllm_kvevict.policies.base import KeptTokens  # noqa: E402
from vllm_kvevict.policies.registry import build_policy  # noqa: E402

NEEDLE_TASKS = (
    "niah_single_essay,niah_single_digits,niah_single_noise,niah_multikey,niah_multikey_hard,"
    "niah_multivalue,niah_multiquery"
)
BLOCK_SIZE = 32
QUERY_WINDOW = 32


def value_coverage(
    kept: list[KeptTokens], positions: list[int], heads: set[tuple[int, int]]
) -> tuple[float, float]:
    """(share of all (layer, head) pairs, share of ``heads``) whose kept set holds all of ``positions``."""
    wanted = torch.tensor(positions)
    holding = {
        (layer_idx, head)
        for layer_idx, layer in enumerate(kept)
        for head in range(layer.counts.numel())
        if bool(torch.isin(wanted, layer.head(head)).all())
    }
    pairs = sum(layer.counts.numel() for layer in kept)
    return len(holding) / pairs, len(holding & heads) / len(heads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=NEEDLE_TASKS)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--method", default="ada-snapkv")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--chunk-budget", type=float, default=1.5, help="I as a multiple of B'")
    parser.add_argument("--top", type=int, default=10, help="retrieval heads per value")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard", default="0/1", help="k/m: every m-th prompt from the k-th (one per core)")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per prompt")
    args = parser.parse_args()
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    model, tokenizer = load_reference_model(prepared_model_dir())
    samples = generate_samples(
        args.tasks.split(","), [args.length], args.samples, args.seed, PromptFormat(tokenizer)
    )
    shard, shards = map(int, args.shard.split("/"))
    policy = build_policy(args.method)
    for sample in samples[shard::shards]:
        started = time.time()
        ids = torch.tensor(sample.token_ids)
        whole = prefill(model, ids, query_window=QUERY_WINDOW)
        plan = plan_request(len(ids), args.fraction, BLOCK_SIZE, policy, len(whole.layers))
        kept_whole = [
            policy.select(layer, min(plan.layer_budgets[i], len(ids))) for i, layer in enumerate(whole.layers)
        ]
        chunked = chunked_prefill(model, ids, policy, with_chunk_budget(plan, args.chunk_budget), args.chunk)
        values = []  # per answer: its positions and its retrieval heads (full cache)
        for answer in sample.answers:
            positions = value_positions(tokenizer, sample.token_ids, answer)
            values.append((positions, retrieval_heads(whole.layers, positions, args.top)))
        row: dict[str, object] = {"sample": sample.id, "task": sample.task, "method": args.method}
        for label, kept in (("whole", kept_whole), ("chunked", chunked.kept)):
            shares = [value_coverage(kept, positions, heads) for positions, heads in values]
            row[label] = [sum(share[i] for share in shares) / len(shares) for i in (0, 1)]
        with args.out.open("a") as out:
            out.write(json.dumps(row) + "\n")
        took = time.time() - started
        print(f"{sample.id}: {took:.0f}s whole {row['whole']} chunked {row['chunked']}", flush=True)


if __name__ == "__main__":
    main()
