"""Peak KV blocks of one prompt under each per-chunk rule, from the accounting rule the scheduler applies.

A request prefilled in ``--chunk``-token chunks holds, while a chunk is computed, the blocks its plan keeps
after the previous evicting chunk plus the chunk's own (``RequestPlan.blocks_freed_at``: what the scheduler
frees); the peak is the largest of those over the prompt's chunks, and after the last chunk the plan's
whole-prompt budget. Vanilla (and whole-prompt eviction, evicted only once the prompt is complete) holds the
whole prompt. The through-server peak of one 4k prompt (2026-11-24, 41 blocks at 512-token chunks and
``--kv-budget 512``: docs/history/2026-11-24-benchmarks-per-chunk-eviction.md) equals this count. Prints
one markdown table of ratios to vanilla.

    .venv/bin/python benchmarks/policy_quality/chunk_peaks.py --lengths 4096,7168 --trailing-windows 128,256
"""

from __future__ import annotations

import argparse

from vllm_kvevict.layout.accounting import RequestPlan, cdiv, plan_request, with_chunk_budget
from vllm_kvevict.policies.between_chunks import BetweenRule, trailing_floor
from vllm_kvevict.policies.registry import build_policy
from vllm_kvevict.settings.parsers import parse_chunk_budget

BLOCK_SIZE = 32
NUM_LAYERS = 30  # SmolLM2-135M


def peak_blocks(plan: RequestPlan, chunk: int) -> int:
    """Blocks one request holds at its peak while its prompt is computed in ``chunk``-token steps."""
    peak, done = 0, 0
    while done < plan.prompt_len:
        step = min(chunk, plan.prompt_len - done)
        peak = max(peak, cdiv(done + step, plan.block_size) - plan.blocks_freed_at(done))
        done += step
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="ada-snapkv")
    parser.add_argument("--lengths", default="4096,7168")
    parser.add_argument("--fractions", default="0.25,0.1")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument(
        "--chunk-budgets",
        default="1.5",
        help="comma list of I: multiples of B' (1.5) or tokens per KV head (1024)",
    )
    parser.add_argument("--trailing-windows", default="128,256")
    parser.add_argument("--between", default="blend", help="the rule whose minimum floors a trailing plan")
    args = parser.parse_args()
    policy = build_policy(args.method)
    floor = trailing_floor(policy, BetweenRule(args.between))
    windows = [int(w) for w in args.trailing_windows.split(",") if w]
    budgets = [parse_chunk_budget(b) for b in args.chunk_budgets.split(",") if b]
    rules = [f"I = {b:g} B'" if isinstance(b, float) else f"I = {b}" for b in budgets]
    rules += [f"trailing window {w}" for w in windows]
    print("| length | kept | vanilla blocks | " + " | ".join(rules) + " |")
    print("|---:|---:|---:|" + "---:|" * len(rules))
    for length in (int(x) for x in args.lengths.split(",")):
        for fraction in (float(x) for x in args.fractions.split(",")):
            plan = plan_request(length, fraction, BLOCK_SIZE, policy, NUM_LAYERS)
            plans = [with_chunk_budget(plan, b) for b in budgets]
            plans += [with_chunk_budget(plan, 1.0, 0, w, floor) for w in windows]
            vanilla = cdiv(length, BLOCK_SIZE)
            peaks = [peak_blocks(p, args.chunk) for p in plans]
            cells = [f"{peak} ({peak / vanilla:.2f}×)" for peak in peaks]
            print(f"| {length} | {fraction:.0%} | {vanilla} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
