"""``vllm-kvevict calibrate``'s work: KVzip+ targets on the corpus, per-layer fits, held-out fit, scorers.

Contexts are split by context (the last ``held_out`` contexts are never fitted on). Every feature set is
fitted as a linear and an MLP scorer, each head on its own features (``separate``) and on every head's
(``joint``), and measured on the held-out contexts; KVzap's own input (the attention module's input hidden
states, not servable here: the served cache holds keys and values only; fitted joint, they are not per head)
and the key norm (KNorm's rule) are measured beside them as comparison points. The scorers of ``features``
and ``fit.heads`` are written, their weights in ``dtype``, and their held-out fit is measured again on the
written (rounded) weights.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_kvevict.calibration.config import CalibrationConfig, FitConfig
from vllm_kvevict.calibration.corpus import calibration_contexts
from vllm_kvevict.calibration.fit import FITTERS, HEAD_MODES, predict
from vllm_kvevict.calibration.metrics import held_out_fit
from vllm_kvevict.calibration.score_levels import score_levels
from vllm_kvevict.calibration.targets import ContextSample, context_sample
from vllm_kvevict.policies.surrogate_scorer import (
    FEATURE_SETS,
    KINDS,
    WEIGHT_NAMES,
    ScorerSpec,
    SurrogateScorer,
    model_fingerprint,
)

#: architectures whose attention has the Llama layout the KVzip scoring and the served scorer assume
#: (q/k/v/o projections, rotate-half RoPE, the cache holding post-RoPE keys)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
#: the comparison feature set that is not servable: the attention module's input (KVzap's features)
HIDDEN = "hidden-states (KVzap input)"
KEY_NORM = "key norm (KNorm rule)"


def check_architecture(hf_config) -> None:
    """ValueError naming the model's architecture unless it is one ``SUPPORTED_ARCHITECTURES`` lists."""
    names = getattr(hf_config, "architectures", None) or ["(none)"]
    if names[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture {names[0]} is not supported by calibrate; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def rotary_dim(hf_config) -> int:
    """Coordinates of a head that RoPE rotates (all of them unless ``partial_rotary_factor`` says less)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return int(head_dim * float(getattr(hf_config, "partial_rotary_factor", 1.0) or 1.0))


def layer_features(
    samples: list[ContextSample], layer: int, features: str, rotary: int
) -> list[torch.Tensor]:
    """Per context [c, F] features of ``layer`` (a ``FEATURE_SETS`` name, or ``HIDDEN``)."""
    if features == HIDDEN:
        assert all(s.hidden is not None for s in samples)
        return [s.hidden[layer] for s in samples]  # type: ignore[index]
    featurize = FEATURE_SETS[features]
    return [featurize(s.keys[layer], s.values[layer], rotary) for s in samples]


def fit_label(features: str, heads: str) -> str:
    """The report's row name of a feature set fitted with ``heads`` (the hidden states only jointly)."""
    return features if features == HIDDEN else f"{features} ({heads})"


def candidates(config: CalibrationConfig) -> list[tuple[str, str]]:
    """(features, heads) pairs to fit: the written pair first; with ``compare`` every feature set in both
    head modes and the hidden states (joint)."""
    chosen = (config.features, config.fit.heads)
    if not config.compare:
        return [chosen]
    others = [(features, heads) for features in FEATURE_SETS for heads in HEAD_MODES]
    return [chosen, *(pair for pair in others if pair != chosen), (HIDDEN, "joint")]


def fit_and_measure(
    train: list[ContextSample], test: list[ContextSample], features: str, rotary: int, config: FitConfig
) -> tuple[dict[str, list[dict[str, torch.Tensor]]], dict[str, list[dict[str, float]]]]:
    """({kind: per-layer weights}, {kind: per-layer held-out fit}) of one feature set, heads as
    ``config.heads`` says."""
    weights: dict[str, list[dict[str, torch.Tensor]]] = {kind: [] for kind in KINDS}
    fits: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for layer in range(train[0].targets.shape[0]):
        x = torch.cat(layer_features(train, layer, features, rotary))
        y = torch.cat([s.targets[layer].T for s in train])
        x_test = layer_features(test, layer, features, rotary)
        y_test = [s.targets[layer].T for s in test]
        for kind in KINDS:
            fitted = FITTERS[kind](x, y, config)
            weights[kind].append(fitted)
            fits[kind].append(held_out_fit([predict(fitted, xt) for xt in x_test], y_test))
    return weights, fits


def key_norm_fit(test: list[ContextSample]) -> list[dict[str, float]]:
    """Per layer the held-out overlap of KNorm's rule (keep the smallest keys); its R^2 is not meaningful."""
    fits = []
    for layer in range(test[0].targets.shape[0]):
        preds = [-s.keys[layer].norm(dim=-1).T for s in test]
        fits.append({"top25": held_out_fit(preds, [s.targets[layer].T for s in test])["top25"]})
    return fits


def scorer_fit(scorer: SurrogateScorer, test: list[ContextSample]) -> list[dict[str, float]]:
    """Per layer the held-out fit of a built scorer, through ``layer_scores`` (what serving computes)."""
    fits = []
    for layer in range(scorer.spec.num_layers):
        preds = [scorer.layer_scores(layer, s.keys[layer], s.values[layer]).T for s in test]
        fits.append(held_out_fit(preds, [s.targets[layer].T for s in test]))
    return fits


def mean_fit(per_layer: list[dict[str, float]]) -> dict[str, float]:
    """Means over layers of every metric."""
    return {key: sum(f[key] for f in per_layer) / len(per_layer) for key in per_layer[0]}


def build_scorer(
    model_name: str,
    hf_config,
    features: str,
    kind: str,
    layers: list[dict[str, torch.Tensor]],
    config: CalibrationConfig,
) -> SurrogateScorer:
    """The scorer of fitted ``layers`` with its weights rounded to ``config.dtype`` (what is written)."""
    fingerprint = model_fingerprint(hf_config)
    spec = ScorerSpec(
        model_name=model_name,
        fingerprint=fingerprint,
        num_layers=int(fingerprint["num_hidden_layers"]),  # type: ignore[arg-type]
        num_kv_heads=int(fingerprint["num_key_value_heads"]),  # type: ignore[arg-type]
        head_dim=int(fingerprint["head_dim"]),  # type: ignore[arg-type]
        rotary_dim=rotary_dim(hf_config),
        kind=kind,
        features=features,
        hidden_dim=config.fit.hidden_dim if kind == "mlp" else None,
    )
    dtype = getattr(torch, config.dtype)
    rounded = [
        {k: v.to(dtype).float() if k in WEIGHT_NAMES else v for k, v in layer.items()} for layer in layers
    ]
    return SurrogateScorer(spec, rounded)


def calibrate(
    model,
    tokenizer,
    model_name: str,
    out: Path,
    config: CalibrationConfig,
    log: Callable[[str], None] = print,
) -> dict:
    """Run the calibration and write ``out/linear`` and ``out/mlp``; the report (also ``out/fit.json``)."""
    check_architecture(model.config)
    if not 0 < config.held_out < config.num_contexts:
        raise ValueError(f"held_out={config.held_out} must be in [1, num_contexts={config.num_contexts})")
    started = time.monotonic()
    contexts = calibration_contexts(
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        config.num_contexts,
        config.min_tokens,
        config.max_tokens,
        seed=config.seed,
    )
    samples = []
    for i, ids in enumerate(contexts):
        t0 = time.monotonic()
        samples.append(context_sample(model, tokenizer, ids, config.chunk_size, keep_hidden=config.compare))
        log(f"context {i + 1}/{len(contexts)}: {len(ids)} tokens, KVzip+ in {time.monotonic() - t0:.1f} s")
    targets_s = time.monotonic() - started
    train, test = samples[: -config.held_out], samples[-config.held_out :]
    rotary = rotary_dim(model.config)
    table: dict[str, dict[str, dict[str, float]]] = {}
    per_layer: dict[str, dict[str, list[dict[str, float]]]] = {}
    chosen = None
    fits_started = time.monotonic()
    for features, heads in candidates(config):
        fit_config = dataclasses.replace(config.fit, heads=heads)
        weights, fits = fit_and_measure(train, test, features, rotary, fit_config)
        label = fit_label(features, heads)
        per_layer[label] = fits
        table[label] = {kind: mean_fit(fits[kind]) for kind in KINDS}
        log(f"fitted {label}: " + ", ".join(f"{k} top-25% {table[label][k]['top25']:.3f}" for k in KINDS))
        if (features, heads) == (config.features, config.fit.heads):
            chosen = weights
    fits_s = time.monotonic() - fits_started
    per_layer[KEY_NORM] = {"-": key_norm_fit(test)}
    table[KEY_NORM] = {"-": mean_fit(per_layer[KEY_NORM]["-"])}
    assert chosen is not None
    written = {}
    for kind in KINDS:
        scorer = build_scorer(model_name, model.config, config.features, kind, chosen[kind], config)
        shipped = mean_fit(scorer_fit(scorer, test))
        fit = {
            "held_out": shipped,
            "heads": config.fit.heads,
            "weights_dtype": config.dtype,
            "train_contexts": len(train),
            "train_tokens": sum(s.num_tokens for s in train),
            "held_out_contexts": len(test),
            "held_out_tokens": sum(s.num_tokens for s in test),
            "context_tokens": [config.min_tokens, config.max_tokens],
            "seed": config.seed,
            "corpus": "Python standard library docstrings (vllm_kvevict.calibration.corpus)",
            "metrics": "R^2 of log KVzip+ scores per head; top25: overlap of predicted and KVzip+ top-25 % "
            "per context and head; means over layers",
        }
        levels = score_levels(scorer, ((s.keys, s.values) for s in samples))
        spec = ScorerSpec(**{**scorer.spec.__dict__, "fit": fit, "score_levels": levels})
        final = SurrogateScorer(spec, scorer.layers)
        final.save(out / kind, dtype=getattr(torch, config.dtype))
        written[kind] = {"dir": str(out / kind), "held_out": shipped}
    report = {
        "model": model_name,
        "features": config.features,
        "heads": config.fit.heads,
        "table": table,
        "per_layer": per_layer,
        "scorers": written,
        "contexts": len(samples),
        "tokens": sum(s.num_tokens for s in samples),
        "targets_seconds": round(targets_s, 1),
        "fits_seconds": round(fits_s, 1),
        "total_seconds": round(time.monotonic() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    return report


def format_table(report: dict) -> str:
    """The held-out fit, one line per feature set and kind."""
    lines = [f"{'features (heads)':<30} {'kind':<7} {'R^2':>7} {'top-25% overlap':>16}"]
    for features, kinds in report["table"].items():
        for kind, fit in kinds.items():
            r2 = f"{fit['r2']:.3f}" if "r2" in fit else "-"
            lines.append(f"{features:<30} {kind:<7} {r2:>7} {fit['top25']:>16.3f}")
    for kind, entry in report["scorers"].items():
        fit = entry["held_out"]
        lines.append(
            f"written {kind} scorer ({fit_label(report['features'], report['heads'])}): R^2 {fit['r2']:.3f}, "
            f"top-25% overlap {fit['top25']:.3f} -> {entry['dir']}"
        )
    return "\n".join(lines)
