"""Per-layer levels of a learned scorer's predictions: the mean and standard deviation of its scores over
calibration text, per layer (``ScorerSpec.score_levels``).

The predicted log-scores sit at different levels in different layers, so one threshold keeps very different
counts per layer (``docs/learned_scorer.md``), and a request holds its largest layer's blocks. KVzap's
``threshold_scope: "layer"`` compares ``(score - mean_l) / std_l`` instead. ``calibrate`` records the levels
over its contexts; for a scorer written before, this module measures them on the same contexts (a plain
prefill each, no KVzip pass):

    python -m vllm_kvevict.calibration.score_levels MODEL DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from vllm_kvevict.calibration.corpus import calibration_contexts
from vllm_kvevict.hf_reference.capture import prefill
from vllm_kvevict.hf_reference.kvzip import chat_template_parts, encode
from vllm_kvevict.policies.surrogate_scorer import SPEC_FILE, SurrogateScorer


def score_levels(
    scorer: SurrogateScorer, contexts: Iterable[tuple[list[torch.Tensor], list[torch.Tensor]]]
) -> dict:
    """``{"mean": [L], "std": [L], "contexts": n, "tokens": t}`` of ``scorer``'s predictions over
    ``contexts``: per context, per layer keys/values [H, c, D] as the cache holds them (every head and
    token of a layer pooled)."""
    layers = scorer.spec.num_layers
    total = [0.0] * layers
    squares = [0.0] * layers
    count, tokens, seen = 0, 0, 0
    for keys, values in contexts:
        seen += 1
        tokens += int(keys[0].shape[1])
        for layer in range(layers):
            scores = scorer.layer_scores(layer, keys[layer].float(), values[layer].float()).double()
            total[layer] += float(scores.sum())
            squares[layer] += float((scores * scores).sum())
        count += int(keys[0].shape[0] * keys[0].shape[1])
    if not count:
        raise ValueError("score levels need at least one context token")
    means = [t / count for t in total]
    stds = [max(s / count - m * m, 0.0) ** 0.5 for s, m in zip(squares, means, strict=True)]
    return {"mean": means, "std": stds, "contexts": seen, "tokens": tokens}


def prefill_rows(model, tokenizer, context_ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer keys/values [H, c, D] of a context wrapped as a chat user turn (as ``calibrate`` wraps it),
    from one plain prefill (``hf_reference.capture.prefill``, the cache as it holds them): the context's own
    tokens only."""
    prefix_text, _ = chat_template_parts(tokenizer)
    prefix = encode(tokenizer, prefix_text)
    ids = torch.cat([prefix, torch.tensor(context_ids, dtype=torch.int64)])
    with torch.no_grad():
        prompt = prefill(model, ids, capture=False)
    start = prefix.shape[0]
    return [k[0, :, start:].float() for k in prompt.keys], [v[0, :, start:].float() for v in prompt.values]


def measure(model, tokenizer, directory: Path) -> dict:
    """Measure the levels of the scorer in ``directory`` on the contexts its fit records, and write them
    into its ``scorer.json``."""
    scorer = SurrogateScorer.load(directory)
    fit = scorer.spec.fit
    low, high = fit["context_tokens"]
    contexts = calibration_contexts(
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        int(fit["train_contexts"]) + int(fit["held_out_contexts"]),
        int(low),
        int(high),
        seed=int(fit["seed"]),
    )
    levels = score_levels(scorer, (prefill_rows(model, tokenizer, ids) for ids in contexts))
    spec = dataclasses.replace(scorer.spec, score_levels=levels)
    (Path(directory) / SPEC_FILE).write_text(json.dumps(dataclasses.asdict(spec), indent=2) + "\n")
    return levels


def main() -> None:
    from vllm_kvevict.hf_reference.model import load_reference_model

    parser = argparse.ArgumentParser(description="per-layer score levels of learned scorers")
    parser.add_argument("model")
    parser.add_argument("directories", nargs="+", type=Path)
    args = parser.parse_args()
    model, tokenizer = load_reference_model(args.model)
    for directory in args.directories:
        levels = measure(model, tokenizer, directory)
        print(f"{directory}: {levels['contexts']} contexts, {levels['tokens']} tokens; mean per layer "
              f"{min(levels['mean']):.2f}..{max(levels['mean']):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
