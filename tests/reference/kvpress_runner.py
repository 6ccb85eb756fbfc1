"""Running kvpress 0.5.5 (in ``.venv-ref``) on our tensors, and comparing its kept sets with ours."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from vllm_kvevict.hf_reference.eviction import kept_per_layer
from vllm_kvevict.hf_reference.generation import evicted_mask
from vllm_kvevict.policies.base import LayerKV
from vllm_kvevict.policies.registry import build_policy

ROOT = Path(__file__).resolve().parents[2]
REF_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
SCRIPT = ROOT / "scripts" / "kvpress_reference" / "kept_indices.py"

#: kvpress's defaults (SnapKVPress: window_size 64, kernel_size 5, average pooling) on our side. We
#: configure OUR policies like kvpress, since kvpress has no max pooling.
KVPRESS_ALIKE = {"window": 64, "kernel": 5, "pooling": "avg", "span_after": 0}
#: our methods with a kvpress press (``scripts/kvpress_reference/kept_indices.py``'s PRESSES, which runs in
#: kvpress's environment and cannot be imported here)
SHARED_METHODS = tuple(
    "snapkv pyramidkv ada-snapkv critical-snapkv critical-ada-snapkv streamingllm keydiff knorm".split()
)
#: methods that read every query before RoPE: kvpress gets them in a case of their own (``expected_case``).
EXPECTED_METHODS = ("expected-attention", "ada-expected-attention")
#: kvpress's ExpectedAttentionPress default epsilon (0) for the press alone, its leaderboard's 0.01 for the
#: AdaKV-wrapped one (our default for both).
EXPECTED_EPSILON = {"expected-attention": 0.0, "ada-expected-attention": 0.01}


def require_reference_env() -> None:
    if not REF_PYTHON.exists():
        pytest.fail(f"{REF_PYTHON} is missing: run `make install-ref` (make test does it)")


def case_dict(layers: list[LayerKV], jobs: list[dict] | None = None) -> dict:
    """The script's input for ``layers``; queries are the last ones captured (kvpress takes its window)."""
    case: dict = {
        "layers": [
            {
                "keys": layer.keys.float(),
                "values": layer.values.float(),
                "queries": layer.queries.float(),
                "o_proj": layer.o_proj.float(),
                "layer_idx": layer.layer_idx,
                "num_layers": layer.num_layers,
            }
            for layer in layers
        ]
    }
    if jobs is not None:
        case["jobs"] = jobs
    return case


def expected_case(layers: list[LayerKV], prerope: list[torch.Tensor], jobs: list[dict]) -> dict:
    """The script's input for the Expected Attention presses: ``layers`` (all n post-RoPE queries, theirs
    unused) plus each layer's pre-RoPE queries [q_heads, n, d] and RoPE frequencies."""
    case = case_dict(layers, jobs)
    for entry, layer, pre in zip(case["layers"], layers, prerope, strict=True):
        assert layer.rope_inv_freq is not None
        entry["prerope_queries"] = pre.float()
        entry["inv_freq"] = layer.rope_inv_freq.float()
    return case


def run_kvpress(cases: dict[str, dict], work: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{case name: {job key: kept bool [layers, kv_heads, n]}}; one subprocess for all cases."""
    require_reference_env()
    paths = []
    for name, case in cases.items():
        path = work / f"{name}.pt"
        torch.save(case, path)
        paths.append(path)
    done = subprocess.run(
        [str(REF_PYTHON), str(SCRIPT), "--out-dir", str(work), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        pytest.fail(f"kvpress reference script failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {name: torch.load(work / f"{name}.kvpress.pt", weights_only=True) for name in cases}


def kvpress_budget(num_tokens: int, compression_ratio: float) -> int:
    """kvpress's ``compute_n_kept``: per-head kept tokens for a compression ratio."""
    return max(1, int(num_tokens * (1 - compression_ratio)))


def our_kept(method: str, layers: list[LayerKV], compression_ratio: float, **params) -> torch.Tensor:
    """Our kept mask [layers, kv_heads, n] for ``method`` at kvpress's per-head budget."""
    policy = build_policy(method, **params)
    n = layers[0].num_tokens
    kept = kept_per_layer(policy, layers, kvpress_budget(n, compression_ratio))
    return torch.stack([~evicted_mask(layer_kept, n) for layer_kept in kept])


def method_params(method: str, extra: dict | None = None) -> dict:
    """Our parameters matching kvpress's defaults for ``method`` (+ ``extra``)."""
    # KeyDiffPress and KnormPress keep no sinks, no window and no span: ours without them is the same score.
    key_scored = {"window": 0, "sinks": 0, "span_after": 0}
    own = {"streamingllm": {}, "keydiff": key_scored, "knorm": key_scored}
    for name in EXPECTED_METHODS:  # no window, no span (the press's score), kvpress's epsilon
        own[name] = {"window": 0, "span_after": 0, "epsilon": EXPECTED_EPSILON[name]}
    params = dict(own.get(method, KVPRESS_ALIKE))
    params.update(extra or {})
    return params
