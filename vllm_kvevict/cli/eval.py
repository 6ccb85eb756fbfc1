"""``vllm-kvevict eval``: RULER-style long-context accuracy of any OpenAI-compatible server, or ``--compare``
(vanilla vLLM vs eviction methods at several budgets, started here, plus kvpress presses side by side)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_kvevict.server_process import add_eager_flag

DEFAULT_LENGTHS = "1k,2k,4k,7k"


def parse_length(text: str) -> int:
    """``"4k"`` -> 4096, ``"1500"`` -> 1500 (prompt tokens)."""
    value = text.strip().lower()
    try:
        tokens = int(float(value[:-1]) * 1024) if value.endswith("k") else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad length {text!r}: use token counts like 1500 or 1k, 2k, 4k, 7k (k = 1024)"
        ) from None
    if tokens <= 0:
        raise argparse.ArgumentTypeError(f"bad length {text!r}: must be a positive number of tokens")
    return tokens


def parse_lengths(text: str) -> list[int]:
    return [parse_length(part) for part in text.split(",") if part.strip()]


def parse_budgets(text: str) -> list[float]:
    """Kept fractions in (0, 1), e.g. ``"0.5,0.25,0.1,0.05"``."""
    budgets = []
    for part in filter(str.strip, text.split(",")):
        try:
            budget = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad budget {part!r}: use kept fractions in (0, 1)") from None
        if not 0.0 < budget < 1.0:
            raise argparse.ArgumentTypeError(f"bad budget {part!r}: a kept fraction must lie in (0, 1)")
        budgets.append(budget)
    return budgets


def parse_names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def register(subparsers: argparse._SubParsersAction) -> None:
    from vllm_kvevict.evaluation.tasks import ALL_TASKS, TASKS

    parser = subparsers.add_parser(
        "eval",
        help="long-context accuracy (RULER-style tasks) of an OpenAI-compatible server, or --compare",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--base-url", help="server to evaluate, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="served model name (default: the first one the server lists)")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument(
        "--tasks",
        type=parse_names,
        default=list(TASKS),
        help="comma list of: " + ",".join(ALL_TASKS) + " (default: the question-last ones)",
    )
    parser.add_argument(
        "--lengths",
        type=parse_lengths,
        default=parse_lengths(DEFAULT_LENGTHS),
        help=f"prompt lengths in tokens, comma list (default {DEFAULT_LENGTHS}; k = 1024)",
    )
    parser.add_argument("--samples", type=int, default=4, help="samples per (task, length)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer", type=Path, help="served model's tokenizer directory (default: the bundled model)"
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="results as JSON lines (default: eval-results.jsonl; with --compare: RESULTS_DIR)",
    )
    parser.add_argument("--samples-output", type=Path, help="also write the generated samples (JSON lines)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    compare = parser.add_argument_group("compare mode (starts vLLM servers itself)")
    compare.add_argument(
        "--compare",
        action="store_true",
        help="vanilla vLLM + one server per method x budget, kvpress presses; writes a report",
    )
    compare.add_argument(
        "--methods", type=parse_names, default=[], help="eviction methods, e.g. snapkv,ada-snapkv"
    )
    compare.add_argument(
        "--budgets",
        type=parse_budgets,
        default=parse_budgets("0.5,0.25,0.1,0.05"),
        help="kept fractions passed as --kv-budget",
    )
    compare.add_argument(
        "--kvpress",
        type=parse_names,
        default=[],
        help="kvpress presses: snapkv,pyramidkv,ada-snapkv,critical-snapkv,critical-ada-snapkv,streamingllm",
    )
    compare.add_argument(
        "--kvpress-modes",
        type=parse_names,
        default=["aware", "agnostic"],
        help="aware: question inside the compressed prompt; agnostic: question after",
    )
    compare.add_argument(
        "--kvpress-python",
        type=Path,
        default=Path(".venv-ref/bin/python"),
        help="python of the kvpress reference environment",
    )
    compare.add_argument(
        "--results-dir",
        type=Path,
        default=Path("eval-results"),
        help="one results file per configuration; existing complete files are reused",
    )
    compare.add_argument("--report", type=Path, default=Path("docs/quality.md"))
    compare.add_argument("--plots-dir", type=Path, default=Path("docs/img"))
    compare.add_argument(
        "--kv-cache-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE per server"
    )
    compare.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="--block-size of every server: eviction frees whole blocks, so a kept fraction is rounded up "
        "to them; 32 (the CPU backend's smallest) keeps 5%% and 10%% of a 1k prompt apart",
    )
    compare.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="--kv-cache-dtype of every server, vanilla too (e.g. fp8; default: auto, the model's dtype)",
    )
    add_eager_flag(compare.add_argument)
    compare.add_argument("--report-only", action="store_true", help="rebuild the report from --results-dir")
    parser.set_defaults(handler=run)


def _prompt_format(args: argparse.Namespace):
    from vllm_kvevict.evaluation.prompt_format import PromptFormat

    if args.tokenizer is not None:
        return PromptFormat.from_path(args.tokenizer), args.tokenizer
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    model_dir = prepared_model_dir()
    return PromptFormat.from_path(model_dir), model_dir


def _validate(args: argparse.Namespace) -> None:
    from vllm_kvevict.evaluation.tasks import get_task

    for name in args.tasks:
        get_task(name)
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    if not args.compare and not args.base_url:
        raise ValueError("--base-url is required (or use --compare to start servers)")


def run(args: argparse.Namespace) -> int:
    try:
        _validate(args)
    except ValueError as exc:
        print(f"vllm-kvevict eval: {exc}", file=sys.stderr)
        return 2
    if args.compare:
        return run_compare_mode(args)
    return run_single(args)


def run_compare_mode(args: argparse.Namespace) -> int:
    from vllm_kvevict.evaluation.compare import run_compare
    from vllm_kvevict.evaluation.generate import generate_samples

    fmt, model_dir = _prompt_format(args)
    samples = (
        [] if args.report_only else generate_samples(args.tasks, args.lengths, args.samples, args.seed, fmt)
    )
    return run_compare(args, samples, Path(model_dir))


def run_single(args: argparse.Namespace) -> int:
    from vllm_kvevict.evaluation.generate import generate_samples
    from vllm_kvevict.evaluation.results import summary_table, write_results
    from vllm_kvevict.evaluation.runner import make_client, run_samples, served_model
    from vllm_kvevict.evaluation.sample import write_samples

    fmt, _ = _prompt_format(args)
    samples = generate_samples(args.tasks, args.lengths, args.samples, args.seed, fmt)
    if args.samples_output:
        write_samples(args.samples_output, samples)
    client = make_client(args.base_url, args.api_key)
    model = args.model or served_model(client)
    results = run_samples(
        client, model, samples, config=model, concurrency=args.concurrency, progress=not args.no_progress
    )
    output = args.output or Path("eval-results.jsonl")
    write_results(output, results)
    print(summary_table(results))
    print(f"\n{len(results)} results written to {output}")
    return 1 if any(r.error for r in results) else 0
