"""Which (layer, KV head) pairs retrieve needles, and is that set the same from prompt to prompt?

For every needle answer of the eval generator's needle tasks (4k, full cache, HF runner), each pair's window
attention on the answer's value tokens (the question's last ``QUERY_WINDOW`` queries, GQA mean) is written
out. ``--analyse`` then builds a static set from calibration prompts (another generator seed) — the pairs
with the most value attention, each answer's share normalised to 1 — and reports how much of every
evaluation answer's top-10 pairs it holds.

    .venv/bin/python benchmarks/policy_quality/retrieval_heads.py --seed 1 --samples 2 --out cal.jsonl
    .venv/bin/python benchmarks/policy_quality/retrieval_heads.py --seed 0 --samples 3 --out eval.jsonl
    .venv/bin/python benchmarks/policy_quality/retrieval_heads.py --analyse cal.jsonl eval.jsonl \
        --heads-out heads.json --size 18
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chunked_needle_coverage import NEEDLE_TASKS, QUERY_WINDOW  # noqa: E402
from needle_coverage import top_pairs, value_attention, value_positions  # noqa: E402

from vllm_kvevict.evaluation.generate import generate_samples  # noqa: E402
from vllm_kvevict.evaluation.prompt_format import PromptFormat  # noqa: E402
from vllm_kvevict.hf_reference import load_reference_model, prefill  # noqa: E402

#: one answer: [layer, head, value attention] for every pair (``needle_coverage.value_attention``)
AnswerMass = list[list[float]]


def static_set(answers: list[AnswerMass], size: int) -> list[tuple[int, int]]:
    """The ``size`` pairs with the most value attention over ``answers``, each answer normalised to 1."""
    total: dict[tuple[int, int], float] = defaultdict(float)
    for mass in answers:
        norm = sum(value for _, _, value in mass) or 1.0
        for layer, head, value in mass:
            total[(int(layer), int(head))] += value / norm
    return [pair for pair, _ in sorted(total.items(), key=lambda item: -item[1])[:size]]


def load_answers(path: Path) -> list[AnswerMass]:
    """Every answer's rows in a file this script wrote."""
    return [mass for line in path.read_text().splitlines() for mass in json.loads(line)["answers"]]


def analyse(cal: list[AnswerMass], ev: list[AnswerMass], sizes: list[int]) -> None:
    print(f"{len(cal)} calibration answers, {len(ev)} evaluation answers")
    for size in sizes:
        chosen = set(static_set(cal, size))
        overlap = sum(len(chosen & top_pairs(mass, 10)) / 10 for mass in ev) / len(ev)
        print(f"static set of {size}: holds {overlap:.2f} of each evaluation answer's top-10 pairs (mean)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="generator seed (the eval suite uses 0)")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--shard", default="0/1", help="k/m: every m-th prompt from the k-th (one per core)")
    parser.add_argument("--out", type=Path, help="JSON lines, one per prompt")
    parser.add_argument("--analyse", type=Path, nargs=2, metavar=("CALIBRATION", "EVALUATION"))
    parser.add_argument("--sizes", default="6,9,12,18,30")
    parser.add_argument("--size", type=int, default=18, help="pairs in --heads-out")
    parser.add_argument("--heads-out", type=Path, help="write the calibration's static set here (JSON)")
    args = parser.parse_args()
    if args.analyse:
        cal, ev = (load_answers(path) for path in args.analyse)
        analyse(cal, ev, [int(s) for s in args.sizes.split(",")])
        if args.heads_out:
            args.heads_out.write_text(json.dumps([list(pair) for pair in static_set(cal, args.size)]))
        return
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    torch.set_num_threads(1)
    model, tokenizer = load_reference_model(prepared_model_dir())
    samples = generate_samples(
        NEEDLE_TASKS.split(","), [args.length], args.samples, args.seed, PromptFormat(tokenizer)
    )
    shard, shards = map(int, args.shard.split("/"))
    for sample in samples[shard::shards]:
        started = time.time()
        whole = prefill(model, torch.tensor(sample.token_ids), query_window=QUERY_WINDOW)
        answers = [
            value_attention(whole.layers, value_positions(tokenizer, sample.token_ids, answer))
            for answer in sample.answers
        ]
        row = {"sample": sample.id, "task": sample.task, "seed": args.seed, "answers": answers}
        with args.out.open("a") as out:
            out.write(json.dumps(row) + "\n")
        print(f"{sample.id}: {time.time() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
