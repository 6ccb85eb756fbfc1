"""Parameter sweep: needle retrieval of method variants on the eval suite's own prompts, one prefill each.

Each prompt of the chosen ``vllm-kvevict eval`` tasks (same generator, same seeds as the server runs) is
prefilled once in HF transformers (float32, CPU) with its post-RoPE keys, values and last queries captured;
every variant then selects its kept sets at every kept fraction, question-aware (the whole prompt is
compressed, the first answer token comes from the full prefill, as in the server), and the same masked
runner decodes them greedily. A variant is ``label=method`` or ``label=method:param=value,param=value``
(values parsed as JSON, else kept as strings), so every parameter the registry knows can be swept.
``--kvpress`` adds kvpress 0.5.5's presses at their own defaults (window 64, average pooling 5), chosen on
the same captured tensors in ``.venv-ref`` as ``run.py`` does, as variants ``kvpress:<press>``;
``--kvpress-presses`` picks them (``expected-attention`` and ``ada-expected-attention`` get every position's
query before RoPE, recovered from the captured queries).
Prompts run sample index first (every task and length gets sample 0 before any gets sample 1), so a run cut
short still covers every task. ``--by-task`` prints the mean over tasks (each task's mean over its samples,
tasks weighed equally, as ``eval`` reports it) instead of the mean over prompts.

    .venv/bin/python benchmarks/policy_quality/sweep.py --lengths 4096 --samples 4 \
        --variants 'snapkv=snapkv;snap-span=snapkv:span_after=8' --out /tmp/sweep.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import (  # noqa: E402
    KVPRESS_EXPECTED,
    KVPRESS_PRESSES,
    answer_decided,
    decode_in_batches,
    kvpress_rows,
    start_kvpress,
    write_kvpress_case,
)
from score_cache import reused_scores  # noqa: E402

from vllm_kvevict.evaluation.answer_match import score as score_output  # noqa: E402
from vllm_kvevict.evaluation.generate import generate_sample  # noqa: E402
from vllm_kvevict.evaluation.prompt_format import PromptFormat  # noqa: E402
from vllm_kvevict.evaluation.sample import Sample  # noqa: E402
from vllm_kvevict.evaluation.tasks import get_task  # noqa: E402
from vllm_kvevict.evaluation.tasks.question_first import PREFIX as QUESTION_FIRST_PREFIX  # noqa: E402
from vllm_kvevict.hf_reference import (  # noqa: E402
    kept_per_layer,
    kvpress_kept_count,
    load_reference_model,
    prefill,
)
from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens  # noqa: E402
from vllm_kvevict.policies.method_spec import parse_method_spec  # noqa: E402
from vllm_kvevict.policies.registry import build_policy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: Single-answer needle tasks of the eval suite: an answer is decided at its first wrong digit.
NEEDLE_TASKS = ("niah_single_noise", "niah_single_essay", "niah_single_digits", "niah_multikey")
QUERY_WINDOW = 256
#: Enough for a 7-digit answer after the answer prefix; other tasks decode their own max_new_tokens.
NEEDLE_NEW_TOKENS = 12


def read_records(out: Path) -> list[dict]:
    """The JSON-lines records already in ``out`` (none when it does not exist)."""
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def run_samples(
    args: argparse.Namespace,
    rows_for: Callable[..., list[dict]],
    describe: Callable[[dict], str] = lambda r: f"{r['variant']}@{r['fraction']}={r['score']:.2f}",
) -> list[dict]:
    """Every sample of ``args.tasks`` × ``args.lengths`` × ``args.samples`` (seed ``args.seed``) not yet in
    ``args.out``: ``rows_for(model, tokenizer, sample)`` decoded and scored, appended to ``args.out`` as JSON
    lines as each prompt finishes, each row printed as ``describe`` writes it. Returns every record of the
    file."""
    from vllm_kvevict.cli.prepare_model import prepared_model_dir
    from vllm_kvevict.evaluation.generate import generate_samples
    from vllm_kvevict.hf_reference import load_reference_model

    records = read_records(args.out)
    model, tokenizer = load_reference_model(prepared_model_dir())
    lengths = [int(x) for x in args.lengths.split(",")]
    tasks = args.tasks.split(",")
    samples = generate_samples(tasks, lengths, args.samples, args.seed, PromptFormat(tokenizer))
    done = {r["sample"] for r in records}
    for sample in samples:
        if sample.id in done:
            continue
        started = time.time()
        rows = rows_for(model, tokenizer, sample)
        with args.out.open("a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
        records += rows
        scores = " ".join(describe(r) for r in rows)
        print(f"{sample.id}: {time.time() - started:.0f}s {scores}", flush=True)
    return records


def scored_row(sample: Sample, variant: str, fraction: float, output: str, **extra: object) -> dict:
    """One JSON-lines row: a variant's greedy output on ``sample``, scored like ``eval``."""
    return {
        "variant": variant,
        "fraction": fraction,
        "output": output,
        "score": score_output(output, sample.answers, sample.metric),
        "task": sample.task,
        "length": sample.target_tokens,
        "sample": sample.id,
        "answers": list(sample.answers),
        **extra,
    }


def decode_limits(sample: Sample, tokenizer) -> tuple[int, Callable[[list[int]], bool] | None]:
    """(new tokens, ``finished`` callback) for decoding ``sample``: a single-number answer decodes
    ``NEEDLE_NEW_TOKENS`` and stops once its digits are decided; any other its task's ``max_new_tokens``,
    and so does a question-first sample (no answer prefix: the model writes its own words before the
    number)."""
    if sample.task.startswith(QUESTION_FIRST_PREFIX):
        return sample.max_new_tokens, None
    if len(sample.answers) == 1 and sample.answers[0].isdigit():
        return NEEDLE_NEW_TOKENS, answer_decided(sample.answers[0], tokenizer)
    return sample.max_new_tokens, None


def parse_variants(text: str) -> dict[str, EvictionPolicy]:
    """``'a=snapkv;b=snapkv:window=64,kernel=9'`` -> {label: policy}; bad entries raise ValueError."""
    variants: dict[str, EvictionPolicy] = {}
    for entry in filter(None, (part.strip() for part in text.split(";"))):
        label, _, spec = entry.partition("=")
        if not label or not spec.partition(":")[0]:
            raise ValueError(f"variant {entry!r} must read label=method[:param=value,...]")
        method, params = parse_method_spec(spec)
        variants[label] = build_policy(method, **params)
    return variants


def kept_key(kept: list[KeptTokens]) -> bytes:
    """Identity of a kept set over all layers: every head's sorted kept indices."""
    heads = [layer.head(h) for layer in kept for h in range(layer.counts.numel())]
    counts = torch.tensor([head.numel() for head in heads], dtype=torch.int64)
    return counts.numpy().tobytes() + torch.cat(heads).to(torch.int64).numpy().tobytes()


def sweep_prompt(
    model,
    tokenizer,
    sample,
    variants,
    fractions,
    batch_bytes: float,
    kvpress_python: Path | None = None,
    work_dir: Path = Path("/tmp/kvevict-sweep"),
    presses: tuple[str, ...] = KVPRESS_PRESSES,
) -> list[dict]:
    """Every (variant, fraction) row of one prompt, decoded; plus the full-cache row, and kvpress's
    ``presses`` (variants ``kvpress:<press>``) when ``kvpress_python`` is given."""
    n = len(sample.token_ids)
    expected = kvpress_python is not None and any(press in KVPRESS_EXPECTED for press in presses)
    # H2O, RoCo and Expected Attention score with every prompt query; the others need their window only.
    needed = max([QUERY_WINDOW, *(policy.query_window(n) for policy in variants.values())])
    everything = needed >= n or expected
    prompt = prefill(model, torch.tensor(sample.token_ids), query_window=None if everything else needed)
    kvpress = None
    if kvpress_python is not None:
        work_dir.mkdir(parents=True, exist_ok=True)
        case = work_dir / f"{sample.id}.pt"
        write_kvpress_case(case, prompt.layers, prerope=expected)
        kvpress = start_kvpress(work_dir, [case], fractions, kvpress_python, presses)
    rows = [
        {
            "variant": "full-cache",
            "fraction": 1.0,
            "kept": [KeptTokens.everything(layer.num_kv_heads, n) for layer in prompt.layers],
        }
    ]
    with reused_scores():
        for label, policy in variants.items():
            for fraction in fractions:
                row = {"variant": label, "fraction": fraction}
                try:
                    row["kept"] = kept_per_layer(policy, prompt.layers, kvpress_kept_count(n, fraction))
                except ValueError as error:
                    row["error"] = str(error)
                rows.append(row)
    if kvpress is not None:
        if kvpress.wait() != 0:
            raise RuntimeError(f"kvpress reference script failed with exit code {kvpress.returncode}")
        result = work_dir / f"{sample.id}.kvpress.pt"
        for press_row in kvpress_rows(result, fractions, presses):
            rows.append(
                {
                    "variant": f"kvpress:{press_row['method']}",
                    "fraction": press_row["kept_fraction"],
                    "kept": press_row["kept"],
                }
            )
        case.unlink()
        result.unlink()
    runnable = [row for row in rows if "kept" in row]
    new_tokens, finished = decode_limits(sample, tokenizer)
    # Variants that keep the same tokens (PyramidKV below its pyramid's reach, for one) decode the same text.
    distinct: dict[bytes, int] = {}
    slot = [distinct.setdefault(kept_key(row["kept"]), len(distinct)) for row in runnable]
    kept_rows = [runnable[slot.index(i)]["kept"] for i in range(len(distinct))]
    outputs = decode_in_batches(
        model, prompt, kept_rows, new_tokens, n, [tokenizer.eos_token_id], finished, batch_bytes
    )
    for row, i in zip(runnable, slot, strict=True):
        tokens = outputs[i]
        row["output"] = tokenizer.decode(tokens, skip_special_tokens=True)
        row["score"] = score_output(row["output"], sample.answers, sample.metric)
    for row in rows:
        row.pop("kept", None)
        row.update(
            task=sample.task, length=sample.target_tokens, sample=sample.id, answers=list(sample.answers)
        )
    return rows


def sample_order(
    tasks: list[str], lengths: list[int], samples: int, seed: int, fmt: PromptFormat
) -> list[Sample]:
    """The eval suite's samples (same seeds as ``generate_samples``), sample index outermost."""
    return [
        generate_sample(get_task(task), fmt, length, seed, index)
        for index in range(samples)
        for length in lengths
        for task in tasks
    ]


def cell_scores(records: list[dict], by_task: bool) -> dict[tuple[str, float, int], list[float]]:
    """(variant, fraction, length) -> the scores a cell averages: one per prompt, or with ``by_task`` one
    per task (that task's mean over its samples)."""
    per_task: dict[tuple[str, float, int, str], list[float]] = defaultdict(list)
    for r in records:
        if "score" in r:
            per_task[
                (r["variant"], r["fraction"], r["length"], r["task"] if by_task else r["sample"])
            ].append(r["score"])
    cells: dict[tuple[str, float, int], list[float]] = defaultdict(list)
    for (variant, fraction, length, _), scores in per_task.items():
        cells[(variant, fraction, length)].append(sum(scores) / len(scores))
    return cells


def summarise(records: list[dict], by_task: bool = False) -> str:
    """Markdown table: variant x (fraction @ length), cells = mean score in percent (prompts, or with
    ``by_task`` tasks, averaged)."""
    cells = cell_scores(records, by_task)
    columns = sorted({(f, length) for _, f, length in cells}, key=lambda c: (-c[0], c[1]))
    variants = list(dict.fromkeys(v for v, _, _ in cells))
    lines = [
        "| variant | " + " | ".join(f"{f:g} @ {length}" for f, length in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for variant in variants:
        row = []
        for f, length in columns:
            scores = cells.get((variant, f, length), [])
            row.append(f"{100 * sum(scores) / len(scores):.0f} ({len(scores)})" if scores else "")
        lines.append(f"| {variant} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Needle retrieval of method variants (HF masked runner)")
    parser.add_argument("--variants", required=True, help="'label=method[:param=value,...];...'")
    parser.add_argument("--tasks", default=",".join(NEEDLE_TASKS))
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--fractions", default="0.25,0.1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, required=True, help="JSON lines; prompts already there are skipped"
    )
    parser.add_argument("--batch-bytes", type=float, default=2e9)
    parser.add_argument("--summary-only", action="store_true")
    parser.add_argument("--by-task", action="store_true", help="summary cells: mean over tasks (n tasks)")
    parser.add_argument(
        "--kvpress",
        action="store_true",
        help=f"also kvpress's presses ({', '.join(KVPRESS_PRESSES)}) at their defaults, via .venv-ref",
    )
    parser.add_argument(
        "--kvpress-presses",
        default=",".join(KVPRESS_PRESSES),
        help=f"with --kvpress: which presses (also {', '.join(KVPRESS_EXPECTED)}: every query is captured)",
    )
    parser.add_argument("--ref-python", type=Path, default=ROOT / ".venv-ref" / "bin" / "python")
    args = parser.parse_args()
    variants = parse_variants(args.variants)
    fractions = [float(x) for x in args.fractions.split(",")]
    presses = tuple(args.kvpress_presses.split(","))
    records = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    if not args.summary_only:
        from vllm_kvevict.cli.prepare_model import prepared_model_dir

        model_dir = prepared_model_dir()
        model, tokenizer = load_reference_model(model_dir)
        fmt = PromptFormat(tokenizer)
        lengths = [int(x) for x in args.lengths.split(",")]
        samples = sample_order(args.tasks.split(","), lengths, args.samples, args.seed, fmt)
        done = {(r["sample"], r["variant"], r["fraction"]) for r in records}
        for sample in samples:
            todo = {
                label: p
                for label, p in variants.items()
                if any((sample.id, label, f) not in done for f in fractions)
            }
            press_todo = args.kvpress and any(
                (sample.id, f"kvpress:{press}", f) not in done for press in presses for f in fractions
            )
            if not todo and not press_todo:
                continue
            started = time.time()
            kvpress_python = args.ref_python if press_todo else None
            rows = sweep_prompt(
                model, tokenizer, sample, todo, fractions, args.batch_bytes, kvpress_python, presses=presses
            )
            rows = [r for r in rows if (r["sample"], r["variant"], r["fraction"]) not in done]
            with args.out.open("a") as out:
                for row in rows:
                    out.write(json.dumps(row) + "\n")
            records += rows
            print(
                f"{sample.id}: {time.time() - started:.0f}s "
                + " ".join(f"{r['variant']}@{r['fraction']}={r.get('score', 'err')}" for r in rows),
                flush=True,
            )
    print(summarise(records, args.by_task))


if __name__ == "__main__":
    main()
