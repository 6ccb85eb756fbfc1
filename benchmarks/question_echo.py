"""The question echo through the API (issue 32): needle prompts with the question before the document and
after it, vanilla vLLM against Ada-SnapKV with and without ``question_echo``, same samples, same KV pool.

Servers, one after the other (block size 32, same ``--max-model-len``): vanilla vLLM at its defaults, then
``--kv-eviction ada-snapkv --kv-budget F`` for each ``--budgets`` fraction, without the echo
(``--kv-eviction-config '{"question_echo": 0}'``, the default before the echo) and with
``'{"question_echo": W}'`` (``--echo-only``: the echo servers only); ``--prefill whole,chunked`` adds the
same servers evicting per chunk (``"prefill": "chunked"``, 512-token chunks; ``chunked-tw<W>``: per chunk
with FastKVzip's trailing window of W tokens, ``"trailing_window": W``). Every server answers the same
samples (``vllm-kvevict eval``'s generator: the four needle tasks in their question-first form ``qfirst_*``
and question-last form, ``--samples`` each, ``--lengths``), greedy through the completions API, scored as
``eval`` scores them. Then the echo's cost: ``--ttft-prompts`` question-first prompts sent one at a time
with ``max_tokens=1``, each with its own ``cache_salt`` (time to the first token = the prefill, the
eviction and, with the echo, the echo forward), mean seconds. Prints one table; ``--out`` saves rows,
per-sample results and the command.

    python -m benchmarks.question_echo --lengths 7168 --samples 4 --budgets 0.25,0.1 \
        --out docs/results/2026-11-27-question-echo/question_echo-7k.json
    python -m benchmarks.question_echo --lengths 4096 --ttft-only --ttft-prompts 8 \
        --out docs/results/2026-11-27-question-echo/ttft-4k.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from vllm_kvevict.cli.prepare_model import prepared_model_dir
from vllm_kvevict.evaluation.generate import generate_samples
from vllm_kvevict.evaluation.prompt_format import PromptFormat
from vllm_kvevict.evaluation.runner import make_client, run_samples
from vllm_kvevict.server_process import VLLMServer

NEEDLES = ("niah_single_essay", "niah_multikey", "niah_single_noise", "niah_single_digits")
BLOCK_SIZE = 32


#: vLLM's chunk for the servers that evict a prompt chunk by chunk (``prefill: chunked``)
CHUNK_TOKENS = 512


def server_configs(
    budgets: list[float],
    width: int,
    without_echo: bool = True,
    prefills: tuple[str, ...] = ("whole",),
    learned: bool = False,
) -> list[tuple[str, tuple[str, ...]]]:
    """(name, extra ``vllm serve`` args) of every server, vanilla first; per budget and ``prefills`` mode
    (``whole``: the default; ``chunked``: ``prefill: chunked`` at ``CHUNK_TOKENS``-token chunks) one with
    the echo and, with ``without_echo``, one with ``question_echo: 0``; with ``learned``, per budget one
    ``ada-kvzap`` server (the learned question-agnostic scorer, packaged for the bundled model; no echo)."""
    configs = [("vanilla", ())]
    for budget in budgets:
        for prefill in prefills:
            evicting: tuple[str, ...] = ("--kv-eviction", "ada-snapkv", "--kv-budget", f"{budget:g}")
            mode, suffix = {}, ""
            if prefill.startswith("chunked"):
                evicting += ("--enable-chunked-prefill", "--max-num-batched-tokens", str(CHUNK_TOKENS))
                mode, suffix = {"prefill": "chunked"}, f"-{prefill}"
                if prefill.startswith("chunked-tw"):
                    mode["trailing_window"] = int(prefill.removeprefix("chunked-tw"))
                elif prefill != "chunked":
                    raise ValueError(f"--prefill {prefill!r}: valid modes are whole, chunked, chunked-tw<W>")
            if without_echo:
                off = json.dumps({"question_echo": 0, **mode})  # the default before the echo
                configs.append((f"ada-snapkv{suffix}-{budget:g}", (*evicting, "--kv-eviction-config", off)))
            echo = json.dumps({"question_echo": width, **mode})
            configs.append(
                (f"ada-snapkv{suffix}-echo{width}-{budget:g}", (*evicting, "--kv-eviction-config", echo))
            )
        if learned:
            learned_args = ("--kv-eviction", "ada-kvzap", "--kv-budget", f"{budget:g}")
            configs.append((f"ada-kvzap-{budget:g}", learned_args))
    return configs


def time_to_first_token(client, model: str, prompts: list[str]) -> float:
    """Mean seconds of ``max_tokens=1`` requests, one at a time, each with its own ``cache_salt`` (the
    answered samples' blocks in vLLM's prefix cache must not serve them)."""
    seconds = []
    for index, prompt in enumerate(prompts):
        salt = {"cache_salt": f"ttft-{index}-{time.time_ns()}"}
        start = time.perf_counter()
        client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0, extra_body=salt)
        seconds.append(time.perf_counter() - start)
    return statistics.mean(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096", help="comma list of prompt lengths in tokens")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--budgets", default="0.25,0.1")
    parser.add_argument("--width", type=int, default=32, help="echoed tokens (question_echo)")
    parser.add_argument("--ttft-prompts", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--ttft-only", action="store_true", help="measure the time to first token only")
    parser.add_argument(
        "--tasks", help="comma list of eval tasks (default: the four needle tasks, question first and last)"
    )
    parser.add_argument(
        "--question", choices=("both", "first", "last"), default="both", help="which needle forms to ask"
    )
    parser.add_argument(
        "--echo-only", action="store_true", help="no servers with question_echo: 0 (vanilla and the echo)"
    )
    parser.add_argument(
        "--prefill",
        default="whole",
        help="comma list of eviction modes: whole (the default), chunked, chunked-tw<W> (trailing window W)",
    )
    parser.add_argument(
        "--learned", action="store_true", help="also an ada-kvzap server per budget (the learned scorer)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    model_dir = prepared_model_dir()
    forms = {"first": [f"qfirst_{t}" for t in NEEDLES], "last": list(NEEDLES)}
    needles = [t for form, names in forms.items() if args.question in (form, "both") for t in names]
    tasks = args.tasks.split(",") if args.tasks else needles
    samples = generate_samples(tasks, lengths, args.samples, 0, PromptFormat.from_path(model_dir))
    first = [s.prompt for s in samples if s.task.startswith("qfirst_")]
    ttft_prompts = (first or [s.prompt for s in samples])[: args.ttft_prompts]
    max_len = str(max(s.prompt_tokens for s in samples) + 256)
    rows, results = [], []
    prefills = tuple(args.prefill.split(","))
    for name, extra in server_configs(budgets, args.width, not args.echo_only, prefills, args.learned):
        server_args = ("--block-size", str(BLOCK_SIZE), "--max-model-len", max_len, *extra)
        with VLLMServer(model_dir, extra_args=server_args) as server:
            client = make_client(server.base_url)
            answered = []
            if not args.ttft_only:
                answered = run_samples(
                    client,
                    server.served_model_name,
                    samples,
                    name,
                    concurrency=args.concurrency,
                    progress=False,
                )
            ttft = time_to_first_token(client, server.served_model_name, ttft_prompts)
        results += [asdict(r) for r in answered]
        for length in lengths:
            for first in (True, False):
                cell = [
                    r for r in answered if r.target_tokens == length and r.task.startswith("qfirst_") == first
                ]
                if not cell and answered:
                    continue
                rows.append(
                    {
                        "config": name,
                        "length": length,
                        "question": "first" if first else "last",
                        "correct": sum(1 for r in cell if (r.score or 0.0) >= 1.0),
                        "mean_score": statistics.mean((r.score or 0.0) for r in cell)
                        if cell
                        else float("nan"),
                        "prompts": len(cell),
                        "errors": sum(1 for r in cell if r.error),
                        "ttft_s": ttft,
                    }
                )
        print(json.dumps(rows[-2:]), flush=True)
    vanilla = {(r["length"], r["question"]): r["mean_score"] for r in rows if r["config"] == "vanilla"}
    per_task = {}
    for r in results:
        key = (r["config"], r["task"], r["target_tokens"])
        per_task.setdefault(key, []).append(r["score"] or 0.0)
    vanilla_ttft = next(r["ttft_s"] for r in rows if r["config"] == "vanilla")
    print(f"{'config':28} {'length':>6} {'question':>8} {'score':>6} {'x vanilla':>9} {'ttft s':>7} {'x':>5}")
    for r in rows:
        base = vanilla[(r["length"], r["question"])]
        ratio = r["mean_score"] / base if base else float("nan")
        r["vs_vanilla"] = ratio
        r["ttft_vs_vanilla"] = r["ttft_s"] / vanilla_ttft
        print(
            f"{r['config']:28} {r['length']:>6} {r['question']:>8} {r['mean_score']:>6.3f} {ratio:>9.2f} "
            f"{r['ttft_s']:>7.2f} {r['ttft_vs_vanilla']:>5.2f}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tasks_table = [
            {"config": c, "task": t, "length": n, "mean_score": statistics.mean(v)}
            for (c, t, n), v in per_task.items()
        ]
        record = {"command": " ".join(sys.argv), "rows": rows, "per_task": tasks_table, "results": results}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
