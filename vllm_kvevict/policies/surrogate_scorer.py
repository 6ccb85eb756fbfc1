"""A learned, question-agnostic scorer of KV entries (KVzap-style surrogate of KVzip's scores).

KVzap (arXiv 2601.07891) fits one small model per layer that predicts KVzip's reconstruction scores from the
layer's hidden states. The served datapath does not hold hidden states for entries written in earlier steps,
only their keys and values in the cache, so this surrogate reads what the cache holds: each token's values and
the rotation-invariant part of its post-RoPE keys (the length of every RoPE coordinate pair, unchanged by the
rotation, so a token's features do not depend on its position). A token's score is then a function of its own
cache row only: the same whether it arrived alone, in a chunk or in the whole prompt, and computable again
from the cache at any later eviction (per chunk, at decode, for a kept context).

A scorer is a directory: ``scorer.json`` (what it was fitted for and how) and ``weights.safetensors`` (per
layer ``layers.{i}.mean``/``scale`` feature standardisation, ``w1``/``b1`` and, for an MLP, ``w2``/``b2``).
``vllm-kvevict calibrate`` writes it. Pure torch: no vLLM or transformers import.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

SPEC_FILE = "scorer.json"
WEIGHTS_FILE = "weights.safetensors"
FORMAT_VERSION = 1
KINDS = ("linear", "mlp")
#: the tensors of a layer that ``save`` may store in a narrower dtype (``mean``/``scale`` stay float32)
WEIGHT_NAMES = ("w1", "b1", "w2", "b2")
#: Scorers that ship with the package, one directory each (``scorer.json`` + ``weights.safetensors``).
PACKAGED_SCORERS = Path(__file__).resolve().parent.parent / "scorers"
#: The HF config fields a scorer must agree with: shapes, vocabulary and architecture. They tell models of
#: other configs apart, not weights: a fine-tune or a random-weight model of the same config matches too.
FINGERPRINT_FIELDS = (
    "architecture",
    "num_hidden_layers",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
)


def model_fingerprint(hf_config: Any) -> dict[str, object]:
    """The fields of an HF config (``transformers.PretrainedConfig`` or alike) that a scorer must match."""
    architectures = getattr(hf_config, "architectures", None) or [""]
    heads = hf_config.num_attention_heads
    hidden = hf_config.hidden_size
    return {
        "architecture": architectures[0],
        "num_hidden_layers": hf_config.num_hidden_layers,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(hf_config, "head_dim", None) or hidden // heads,
        "hidden_size": hidden,
        "vocab_size": hf_config.vocab_size,
    }


def kv_pair_norm_features(keys: torch.Tensor, values: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """[n, H * (D - rotary_dim / 2 + D)] float32 features of n tokens from keys/values [H, n, D].

    Per head: the lengths of the key's RoPE pairs (NeoX rotate-half layout: coordinate i pairs with
    i + rotary_dim / 2), the key's coordinates past ``rotary_dim`` as they are, then the value.
    """
    heads, n, dim = keys.shape
    half = rotary_dim // 2
    k = keys.float()
    pair_norms = torch.sqrt(k[..., :half] ** 2 + k[..., half:rotary_dim] ** 2)
    per_head = torch.cat([pair_norms, k[..., rotary_dim:], values.float()], dim=-1)  # [H, n, F/H]
    return per_head.transpose(0, 1).reshape(n, -1)


def kv_log_norm_features(keys: torch.Tensor, values: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """[n, H * (D - rotary_dim / 2 + D + 2)] float32: ``kv_pair_norm_features`` with the pair lengths as
    logs, plus the logs of the key's and the value's lengths. The target is a log-score and KVzip+
    multiplies attention by ``||v W_O||``, so log lengths make the main terms additive for a linear fit."""
    heads, n, dim = keys.shape
    half = rotary_dim // 2
    k, v = keys.float(), values.float()
    pair_norms = torch.sqrt(k[..., :half] ** 2 + k[..., half:rotary_dim] ** 2)
    logs = [
        torch.log(pair_norms + LOG_FLOOR),
        k[..., rotary_dim:],
        v,
        torch.log(k.norm(dim=-1, keepdim=True) + LOG_FLOOR),
        torch.log(v.norm(dim=-1, keepdim=True) + LOG_FLOOR),
    ]
    return torch.cat(logs, dim=-1).transpose(0, 1).reshape(n, -1)


#: added to a length before its log, so a zero pair stays finite
LOG_FLOOR = 1e-4

FEATURE_SETS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "kv-pair-norms": kv_pair_norm_features,
    "kv-log-norms": kv_log_norm_features,
}
#: per-head feature count of each set for head_dim D and rotary_dim r
FEATURES_PER_HEAD: dict[str, Callable[[int, int], int]] = {
    "kv-pair-norms": lambda dim, rotary: rotary // 2 + (dim - rotary) + dim,
    "kv-log-norms": lambda dim, rotary: rotary // 2 + (dim - rotary) + dim + 2,
}


@dataclass(frozen=True)
class ScorerSpec:
    """What a scorer was fitted for (the served model must match) and how it computes."""

    model_name: str
    fingerprint: dict  # model_fingerprint() of the model it was fitted on
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    kind: str  # "linear" or "mlp"
    features: str = "kv-pair-norms"
    hidden_dim: int | None = None  # the MLP's width; None for a linear scorer
    target: str = "log KVzip+ score"
    fit: dict = field(default_factory=dict)  # held-out metrics and how they were measured
    format: int = FORMAT_VERSION
    #: per layer, the mean and standard deviation of the scorer's own predictions over calibration text
    #: (``{"mean": [L], "std": [L], ...}``; ``calibration/score_levels.py``); empty when not measured
    score_levels: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"scorer kind {self.kind!r} is not valid; valid: {', '.join(KINDS)}")
        if self.features not in FEATURE_SETS:
            raise ValueError(
                f"scorer features {self.features!r} are not known; valid: {', '.join(FEATURE_SETS)}"
            )
        if (self.kind == "mlp") != (self.hidden_dim is not None):
            raise ValueError(f"hidden_dim={self.hidden_dim} must be set exactly when kind is 'mlp'")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]"
            )
        missing = [f for f in FINGERPRINT_FIELDS if f not in self.fingerprint]
        if missing:
            raise ValueError(f"scorer fingerprint lacks {', '.join(missing)}")
        if self.format != FORMAT_VERSION:
            raise ValueError(
                f"scorer format {self.format} is not readable; this version reads {FORMAT_VERSION}"
            )

    def layer_level(self, layer_idx: int) -> tuple[float, float]:
        """(mean, std) of layer ``layer_idx``'s predicted scores on calibration text; ValueError when the
        scorer has none (fitted before they were recorded)."""
        if not self.score_levels:
            raise ValueError(
                f"the scorer of {self.model_name} records no per-layer score levels; rerun `vllm-kvevict "
                "calibrate MODEL --out DIR` or `python -m vllm_kvevict.calibration.score_levels MODEL DIR`"
            )
        return float(self.score_levels["mean"][layer_idx]), float(self.score_levels["std"][layer_idx])

    @property
    def input_dim(self) -> int:
        return self.num_kv_heads * FEATURES_PER_HEAD[self.features](self.head_dim, self.rotary_dim)


class SurrogateScorer:
    """Per-layer scores [H, n] of KV entries from their cache rows.

    ``layers[i]`` holds layer i's tensors: ``mean``/``scale`` [F], ``w1`` [F, M], ``b1`` [M] and, for an
    MLP, ``w2`` [M, H], ``b2`` [H] (a linear scorer has M = H and no second layer).
    """

    def __init__(self, spec: ScorerSpec, layers: list[dict[str, torch.Tensor]]) -> None:
        if len(layers) != spec.num_layers:
            raise ValueError(f"scorer has {len(layers)} layers of weights, its spec says {spec.num_layers}")
        out = spec.hidden_dim if spec.kind == "mlp" else spec.num_kv_heads
        for i, layer in enumerate(layers):
            if tuple(layer["w1"].shape) != (spec.input_dim, out):
                raise ValueError(
                    f"layer {i} w1 is {tuple(layer['w1'].shape)}, expected {(spec.input_dim, out)} for {spec}"
                )
        self.spec = spec
        self.layers = [{k: v.float() for k, v in layer.items()} for layer in layers]
        self._featurize = FEATURE_SETS[spec.features]

    def mismatch(self, fingerprint: dict[str, object]) -> str | None:
        """Why this scorer cannot score the model of ``fingerprint`` (``model_fingerprint``), or None."""
        differing = [f for f in FINGERPRINT_FIELDS if self.spec.fingerprint.get(f) != fingerprint.get(f)]
        if differing:
            have = ", ".join(f"{f}={self.spec.fingerprint.get(f)}" for f in differing)
            want = ", ".join(f"{f}={fingerprint.get(f)}" for f in differing)
            return f"the scorer was fitted for {self.spec.model_name} ({have}); the served model has {want}"
        return None

    def layer_scores(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """[H, n] float32 predicted log-scores of the entries keys/values [H, n, D] of layer ``layer_idx``."""
        weights = self.layers[layer_idx]
        x = self._featurize(keys, values, self.spec.rotary_dim).to(weights["w1"].device)
        x = (x - weights["mean"]) / weights["scale"]
        y = x @ weights["w1"] + weights["b1"]
        if self.spec.kind == "mlp":
            y = torch.nn.functional.gelu(y) @ weights["w2"] + weights["b2"]
        return y.transpose(0, 1).contiguous()

    def to(self, device: torch.device | str) -> SurrogateScorer:
        """This scorer with its weights on ``device``."""
        return SurrogateScorer(
            self.spec, [{k: v.to(device) for k, v in layer.items()} for layer in self.layers]
        )

    def save(self, directory: Path | str, dtype: torch.dtype = torch.float32) -> None:
        """Write ``scorer.json`` and ``weights.safetensors`` (the layers' weights in ``dtype``, the feature
        standardisation in float32; ``load`` reads all back as float32) into ``directory`` (created if
        missing)."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {
            f"layers.{i}.{k}": (v.to(dtype) if k in WEIGHT_NAMES else v).contiguous()
            for i, layer in enumerate(self.layers)
            for k, v in layer.items()
        }
        save_file(tensors, str(out / WEIGHTS_FILE))
        (out / SPEC_FILE).write_text(json.dumps(asdict(self.spec), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path | str) -> SurrogateScorer:
        """The scorer saved in ``directory``; ValueError naming the directory when it is not one."""
        from safetensors.torch import load_file

        path = Path(directory)
        if not (path / SPEC_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise ValueError(
                f"{path} is not a scorer directory (needs {SPEC_FILE} and {WEIGHTS_FILE}); "
                "write one with `vllm-kvevict calibrate MODEL --out DIR`"
            )
        spec = ScorerSpec(**json.loads((path / SPEC_FILE).read_text()))
        tensors = load_file(str(path / WEIGHTS_FILE))
        layers: list[dict[str, torch.Tensor]] = [{} for _ in range(spec.num_layers)]
        for name, tensor in tensors.items():
            _, index, key = name.split(".", 2)
            layers[int(index)][key] = tensor
        return cls(spec, layers)


def find_packaged_scorer(fingerprint: dict[str, object], kind: str | None = None) -> Path | None:
    """The directory of a packaged scorer fitted on the model of ``fingerprint`` (of ``kind`` when given;
    an MLP before a linear one otherwise), or None."""
    if not PACKAGED_SCORERS.is_dir():
        return None
    found = []
    for directory in sorted(PACKAGED_SCORERS.iterdir()):
        if not (directory / SPEC_FILE).is_file():
            continue
        spec = json.loads((directory / SPEC_FILE).read_text())
        same = all(spec.get("fingerprint", {}).get(f) == fingerprint.get(f) for f in FINGERPRINT_FIELDS)
        if same and kind in (None, spec.get("kind")):
            found.append((spec.get("kind") != "mlp", directory))
    return min(found)[1] if found else None


def scores_each_head_alone(scorer: SurrogateScorer) -> bool:
    """True when every head's score reads only that head's features (block-diagonal weights: a linear
    scorer's ``w1``; an MLP's hidden units each reading one head's features and feeding that head alone),
    so an entry's score does not depend on what the other heads hold in the same cache row."""
    heads = scorer.spec.num_kv_heads
    for layer in scorer.layers:
        w1 = layer["w1"]  # [H * F, M]
        reads = (w1.reshape(heads, -1, w1.shape[1]) != 0).any(dim=1)  # [H, M]: unit m reads head h
        if scorer.spec.kind == "linear":
            if not torch.equal(
                reads | torch.eye(heads, dtype=torch.bool), torch.eye(heads, dtype=torch.bool)
            ):
                return False
            continue
        feeds = (layer["w2"] != 0).T  # [H, M]: unit m feeds head h
        if bool(((reads | feeds).sum(dim=0) > 1).any()):
            return False
    return True


def scorer_for_heads(scorer: SurrogateScorer, first: int, count: int) -> SurrogateScorer:
    """``scorer`` restricted to KV heads ``[first, first + count)`` (a tensor-parallel rank's heads): each of
    those heads gets the score the whole scorer gives it, read from its own features alone. ValueError when
    the scorer's heads do not score alone (``scores_each_head_alone``) or the range is not its heads'."""
    spec, heads = scorer.spec, scorer.spec.num_kv_heads
    if not 0 <= first < first + count <= heads:
        raise ValueError(f"heads [{first}, {first + count}) are not heads of a {heads}-head scorer")
    if not scores_each_head_alone(scorer):
        raise ValueError(
            f"the scorer of {spec.model_name} scores each head from every head's row; a rank holding "
            f"{count} of its {heads} KV heads cannot use it: fit one whose heads score alone"
        )
    per_head = spec.input_dim // heads
    rows, outputs = slice(first * per_head, (first + count) * per_head), slice(first, first + count)
    layers = []
    for layer in scorer.layers:
        sliced = {"mean": layer["mean"][rows], "scale": layer["scale"][rows]}
        if spec.kind == "linear":
            sliced |= {"w1": layer["w1"][rows, outputs], "b1": layer["b1"][outputs]}
        else:  # the hidden units that read or feed these heads (each reads and feeds one head at most)
            units = (layer["w1"][rows] != 0).any(dim=0) | (layer["w2"][:, outputs] != 0).any(dim=1)
            sliced |= {
                "w1": layer["w1"][rows][:, units],
                "b1": layer["b1"][units],
                "w2": layer["w2"][units][:, outputs],
                "b2": layer["b2"][outputs],
            }
        layers.append(sliced)
    hidden = max(int(layer["w1"].shape[1]) for layer in layers) if spec.kind == "mlp" else None
    if hidden is not None:  # layers may use different counts of units: pad with dead ones
        for layer in layers:
            pad = hidden - int(layer["w1"].shape[1])
            layer["w1"] = torch.nn.functional.pad(layer["w1"], (0, pad))
            layer["b1"] = torch.nn.functional.pad(layer["b1"], (0, pad))
            layer["w2"] = torch.nn.functional.pad(layer["w2"], (0, 0, 0, pad))
    return SurrogateScorer(replace(spec, num_kv_heads=count, hidden_dim=hidden), layers)
