"""Per-chunk eviction with per-head intermediate budgets: do static retrieval heads that hold more between
chunks keep the needle? (issue 11; an HF-runner experiment, not the server's code path.)

Between chunks the server keeps the same count I in every head. Here each layer keeps the same total, H x I,
but a head listed in ``--heads`` (``retrieval_heads.py --heads-out``) gets ``--factors`` times the share of
the others: with one listed head of three and factor 3, 1.8 I against 0.6 I. Every head is scored on its own
(the per-head selection of snapkv-like methods and of the ``between`` rule), so factor 1 reproduces
``hf_reference.chunked_prefill`` exactly (``--sanity N`` checks that on N prompts). Answers are decoded and
scored like ``chunked_vs_whole.py``.

    .venv/bin/python benchmarks/policy_quality/chunked_head_budgets.py --heads heads.json --factors 1,3 \
        --shard 0/2 --out /tmp/head-budgets.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import decode_in_batches  # noqa: E402
from sweep import decode_limits  # noqa: E402

from vllm_kvevict.evaluation.answer_match import score as score_output  # noqa: E402
from vllm_kvevict.evaluation.generate import generate_samples  # noqa: E402
from vllm_kvevict.evaluation.prompt_format import PromptFormat  # noqa: E402
from vllm_kvevict.hf_reference import load_reference_model  # noqa: E402
from vllm_kvevict.hf_reference.capture import recording  # noqa: E402
from vllm_kvevict.hf_reference.chunked import ChunkedPrefill, cached_prompt, chunked_prefill  # noqa: E402
from vllm_kvevict.hf_reference.generation import evicting  # noqa: E402
from vllm_kvevict.layout.accounting import plan_request, with_chunk_budget  # noqa: E402
from vllm_kvevict.policies.base import KeptTokens, LayerKV  # noqa: E402
from vllm_kvevict.policies.between_chunks import DEFAULT_BETWEEN, between_chunks  # noqa: E402
from vllm_kvevict.policies.registry import build_policy  # noqa: E402

TASKS = (
    "fwe,niah_multikey,niah_multikey_hard,niah_multiquery,niah_multivalue,niah_single_digits,"
    "niah_single_essay,niah_single_noise,vt"
)
BLOCK_SIZE = 32


def split_budget(total: int, weights: list[float], limits: list[int]) -> list[int]:
    """Integer budgets summing to min(total, sum(limits)), in proportion to ``weights``, each <= its limit."""
    budgets = [0] * len(weights)
    left = total
    active = [h for h, limit in enumerate(limits) if limit > 0]
    while left > 0 and active:
        weight_sum = sum(weights[h] for h in active)
        shares = {h: max(1, int(left * weights[h] / weight_sum)) for h in active}
        for h in active:
            take = min(shares[h], limits[h] - budgets[h], left)
            budgets[h] += take
            left -= take
        active = [h for h in active if budgets[h] < limits[h]]
    return budgets


def as_kept(per_head: list[torch.Tensor]) -> KeptTokens:
    """``KeptTokens`` of ragged per-head position lists (-1 padded)."""
    counts = torch.tensor([len(p) for p in per_head], dtype=torch.int64)
    indices = torch.full((len(per_head), int(counts.max())), -1, dtype=torch.int64)
    for head, positions in enumerate(per_head):
        indices[head, : len(positions)] = positions
    return KeptTokens(indices, counts)


@torch.inference_mode()
def chunked_prefill_head_budgets(
    model, input_ids: torch.Tensor, policy, plan, chunk: int, head_factor: dict[tuple[int, int], float]
) -> ChunkedPrefill:
    """``hf_reference.chunked_prefill`` with the layer's intermediate total split over its heads by
    ``head_factor`` (default 1) and every head selected on its own; the final chunk keeps the plan's layer
    budget in every head."""
    ids = input_ids.reshape(-1).to(model.device)
    total = int(ids.shape[0])
    intermediate = between_chunks(policy, DEFAULT_BETWEEN)
    cache = DynamicCache(config=model.config)
    num_layers = len(model.model.layers)
    held: list[list[torch.Tensor]] | None = None  # per layer, per head: held positions
    held_end, start, history = 0, 0, []
    while start < total:
        end = min(total, start + chunk)
        final = end == total
        window = max(policy.query_window(end), intermediate.query_window(end))
        masks = evicting(model, [[as_kept(h) for h in held]], held_end) if held is not None else nullcontext()
        with masks, recording(model, window) as recorders:
            out = model(
                input_ids=ids[None, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1
            )
        if final or plan.chunk_rescores(start, end):
            kept_layers = []
            for layer_idx, recorder in enumerate(recorders):
                heads = recorder.keys.shape[0]
                group = recorder.queries.shape[0] // heads
                candidates = [
                    torch.arange(end)
                    if held is None
                    else torch.cat([held[layer_idx][h], torch.arange(held_end, end)])
                    for h in range(heads)
                ]
                if final:
                    budgets = [min(plan.layer_budgets[layer_idx], len(c)) for c in candidates]
                else:
                    weights = [head_factor.get((layer_idx, h), 1.0) for h in range(heads)]
                    budgets = split_budget(
                        heads * plan.kept_length_at(end), weights, [len(c) for c in candidates]
                    )
                kept_heads = []
                for h, positions in enumerate(candidates):
                    layer = LayerKV(
                        keys=recorder.keys[h : h + 1, positions],
                        values=recorder.values[h : h + 1, positions],
                        queries=recorder.queries[h * group : (h + 1) * group],
                        layer_idx=layer_idx,
                        num_layers=num_layers,
                    )
                    selector = policy if final else between_chunks(policy, DEFAULT_BETWEEN, budgets[h])
                    kept_heads.append(positions[selector.select(layer, budgets[h]).head(0)])
                kept_layers.append(kept_heads)
            if final:
                prompt = cached_prompt(ids, cache, out.logits[0, -1].float())
                return ChunkedPrefill(prompt, [as_kept(k) for k in kept_layers], history)
            history.append((end, [as_kept(k) for k in kept_layers]))
            held, held_end = kept_layers, end
        start = end
    raise AssertionError("unreachable: the last chunk returns")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="snapkv", help="a method whose final selection is per head")
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--chunk-budget", type=float, default=1.5, help="I as a multiple of B'")
    parser.add_argument("--heads", type=Path, help="JSON [[layer, head], ...] (retrieval_heads.py)")
    parser.add_argument("--factors", default="1,3")
    parser.add_argument("--shard", default="0/1", help="k/m: every m-th prompt from the k-th (one per core)")
    parser.add_argument("--sanity", type=int, default=0, help="factor 1 == chunked_prefill? (N prompts)")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per prompt and factor")
    args = parser.parse_args()
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    torch.set_num_threads(1)
    model, tokenizer = load_reference_model(prepared_model_dir())
    samples = generate_samples(TASKS.split(","), [args.length], args.samples, 0, PromptFormat(tokenizer))
    shard, shards = map(int, args.shard.split("/"))
    policy = build_policy(args.method)
    listed = {tuple(pair) for pair in json.loads(args.heads.read_text())} if args.heads else set()
    num_layers = len(model.model.layers)
    for index, sample in enumerate(samples[shard::shards]):
        started = time.time()
        ids = torch.tensor(sample.token_ids)
        n = len(ids)
        plan = plan_request(n, args.fraction, BLOCK_SIZE, policy, num_layers)
        plan = with_chunk_budget(plan, args.chunk_budget)
        if index < args.sanity:
            reference = chunked_prefill(model, ids, policy, plan, args.chunk)
            mine = chunked_prefill_head_budgets(model, ids, policy, plan, args.chunk, {})
            pairs = zip(reference.kept, mine.kept, strict=True)
            same = all(torch.equal(a.indices, b.indices) for a, b in pairs)
            print(f"sanity {sample.id}: {'identical' if same else 'DIFFERENT'}", flush=True)
        new_tokens, finished = decode_limits(sample, tokenizer)
        for factor in (float(f) for f in args.factors.split(",")):
            chunked = chunked_prefill_head_budgets(
                model, ids, policy, plan, args.chunk, {pair: factor for pair in listed}
            )
            (tokens,) = decode_in_batches(
                model,
                chunked.prompt,
                [chunked.kept],
                new_tokens,
                n,
                [tokenizer.eos_token_id],
                finished,
                2**31,
            )
            output = tokenizer.decode(tokens, skip_special_tokens=True)
            row = {
                "sample": sample.id,
                "task": sample.task,
                "method": args.method,
                "fraction": args.fraction,
                "factor": factor,
                "heads": len(listed),
                "score": score_output(output, sample.answers, sample.metric),
                "output": output,
                "answers": list(sample.answers),
            }
            with args.out.open("a") as out_file:
                out_file.write(json.dumps(row) + "\n")
            took = time.time() - started
            print(f"{sample.id} factor {factor:g}: {row['score']:.2f} ({took:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
