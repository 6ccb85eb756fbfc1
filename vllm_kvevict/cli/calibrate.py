"""``vllm-kvevict calibrate MODEL --out DIR``: fit the learned scorer of a model (KVzip+ targets, CPU)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DESCRIPTION = """\
Fit the learned, question-agnostic scorer of MODEL (an HF causal LM directory of a Llama-like model).

KVzip+ scores every token of a calibration corpus (the Python standard library's docstrings, parsed from the
interpreter's own source: no download, no evaluation text) by context reconstruction with the HF model in
float32 on CPU; per layer a linear (closed-form ridge) and a 2-layer MLP scorer, one output per KV head, are
fitted to the log-scores from each token's cache row (post-RoPE keys and values), each head from its own
head's features by default (--heads separate: what per-chunk eviction needs), and their fit is printed on
held-out contexts beside the joint fit (every head's features), KVzap's own input (hidden states, not
servable) and the key norm.

Writes DIR/linear and DIR/mlp (each scorer.json + weights.safetensors, loadable by SurrogateScorer.load) and
DIR/fit.json (the full held-out table, per layer). See docs/learned_scorer.md.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, every option with its default."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from vllm_kvevict.calibration.config import CalibrationConfig

    defaults = CalibrationConfig()
    fit = defaults.fit
    parser = subparsers.add_parser(
        "calibrate",
        help="fit the learned scorer of a model (KVzip+ targets, CPU)",
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("model", help="HF model directory (config.json, weights, tokenizer)")
    parser.add_argument("--out", required=True, type=Path, help="directory for linear/, mlp/ and fit.json")
    parser.add_argument("--contexts", type=int, default=defaults.num_contexts, help="calibration contexts")
    parser.add_argument(
        "--held-out", type=int, default=defaults.held_out, help="contexts kept out of the fit and measured on"
    )
    parser.add_argument("--min-tokens", type=int, default=defaults.min_tokens, help="shortest context")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="longest context")
    parser.add_argument(
        "--chunk-size", type=int, default=defaults.chunk_size, help="KVzip reconstruction chunk (tokens)"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="corpus draw and MLP seed")
    parser.add_argument(
        "--features",
        default=defaults.features,
        help="feature set of the written scorers (see policies/surrogate_scorer.py FEATURE_SETS)",
    )
    parser.add_argument(
        "--no-compare",
        action="store_true",
        help="fit only --features (skip the other feature sets and the hidden-state comparison)",
    )
    parser.add_argument(
        "--heads",
        choices=("separate", "joint"),
        default=fit.heads,
        help="separate: each KV head's score reads only its own head's features (block-diagonal weights; "
        "needed for per-chunk eviction); joint: every head's features (for comparison)",
    )
    parser.add_argument("--hidden-dim", type=int, default=fit.hidden_dim, help="MLP width")
    parser.add_argument("--epochs", type=int, default=fit.epochs, help="MLP training epochs")
    parser.add_argument("--ridge", type=float, default=fit.ridge, help="linear scorer's L2 penalty")
    parser.add_argument(
        "--dtype", choices=("float32", "float16", "bfloat16"), default=defaults.dtype, help="written weights"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (None: torch's choice; 1 is faster on a shared machine)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from vllm_kvevict.calibration import pipeline
    from vllm_kvevict.calibration.config import CalibrationConfig, FitConfig
    from vllm_kvevict.policies.surrogate_scorer import FEATURE_SETS

    if args.features not in FEATURE_SETS:
        print(
            f"error: --features {args.features!r} is not known; valid: {', '.join(FEATURE_SETS)}",
            file=sys.stderr,
        )
        return 2
    try:
        hf_config = AutoConfig.from_pretrained(str(args.model))
        pipeline.check_architecture(hf_config)
    except (OSError, ValueError) as error:
        print(f"error: {args.model}: {error}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    config = CalibrationConfig(
        num_contexts=args.contexts,
        held_out=args.held_out,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        chunk_size=args.chunk_size,
        seed=args.seed,
        features=args.features,
        compare=not args.no_compare,
        dtype=args.dtype,
        fit=FitConfig(
            ridge=args.ridge, hidden_dim=args.hidden_dim, epochs=args.epochs, seed=args.seed, heads=args.heads
        ),
    )
    started, cpu_started = time.monotonic(), time.process_time()
    model = AutoModelForCausalLM.from_pretrained(
        str(args.model), dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    try:
        report = pipeline.calibrate(model, tokenizer, Path(args.model).name, args.out, config)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    report["wall_seconds"] = round(time.monotonic() - started, 1)
    report["cpu_seconds"] = round(time.process_time() - cpu_started, 1)
    (args.out / "fit.json").write_text(json.dumps(report, indent=2) + "\n")
    print(pipeline.format_table(report))
    print(
        f"calibrated in {report['wall_seconds']} s wall, {report['cpu_seconds']} s CPU "
        f"({torch.get_num_threads()} threads); wrote {args.out}"
    )
    return 0
