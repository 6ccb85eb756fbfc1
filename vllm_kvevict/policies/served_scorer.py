"""Which learned scorer (``surrogate_scorer.SurrogateScorer``) a policy uses when its ``scorer`` parameter
names no directory: the one this process serves.

The plugin's start-up check (``vllm_adapter/learned_scorer.py``) runs in every vLLM process (API server,
EngineCore, workers) with the same config and calls ``serve_model``: the directory the server's
``--kv-eviction-config`` names, else the packaged scorer fitted on the served model (``find_packaged_scorer``
by its fingerprint), else none. All processes then resolve a policy without a directory to the same scorer,
and a request that asks for a learned method where none exists is refused with the same line on every side.
Outside a server (the HF runner, tests) nothing is served until ``serve_model`` is called; a policy then
needs its own directory. Pure torch: no vLLM import.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vllm_kvevict.policies.surrogate_scorer import SurrogateScorer, find_packaged_scorer, model_fingerprint

if TYPE_CHECKING:
    from vllm_kvevict.policies.base import LayerKV

#: How a server is told which scorer to use, as every refusal says it.
CALIBRATE_HINT = (
    "fit one with `vllm-kvevict calibrate MODEL --out DIR` and start the server with "
    '--kv-eviction-config \'{"scorer": "DIR"}\''
)

_served: dict[str, object] = {"model": None, "directory": None}


def serve_model(hf_config: object, model_name: str, directory: str | Path | None = None) -> str | None:
    """Record the model this process serves and its scorer: ``directory`` when given, else the packaged
    scorer of the model's fingerprint. Returns why the scorer cannot serve the model in one line (no scorer
    for it, a directory that is not a scorer, a scorer fitted on another model), else None."""
    fingerprint = model_fingerprint(hf_config)
    _served["model"] = model_name
    found = Path(directory) if directory is not None else find_packaged_scorer(fingerprint)
    _served["directory"] = None
    if found is None:
        return f"no learned scorer ships for {model_name}; {CALIBRATE_HINT}"
    try:
        scorer = load_scorer(str(found))
    except ValueError as exc:
        return str(exc)
    mismatch = scorer.mismatch(fingerprint)
    if mismatch is not None:
        return f"scorer {found} cannot score {model_name}: {mismatch}; {CALIBRATE_HINT}"
    _served["directory"] = found
    return None


def served_scorer_dir() -> Path | None:
    """The directory of the scorer this process serves (None: no model served, or none for it)."""
    directory = _served["directory"]
    return directory if isinstance(directory, Path) else None


def served_scorer_problem() -> str | None:
    """Why a learned method with no directory of its own cannot run in this process, or None. A process
    that serves no model (the HF runner, tests) has no problem here: its policies name their directory."""
    if _served["model"] is None or served_scorer_dir() is not None:
        return None
    return f"no learned scorer ships for {_served['model']}; {CALIBRATE_HINT}"


def forget_served_model() -> None:
    """Back to serving nothing (tests that call ``serve_model``)."""
    _served.update(model=None, directory=None)


@lru_cache(maxsize=8)
def load_scorer(directory: str, device: str = "cpu") -> SurrogateScorer:
    """The scorer in ``directory`` with its weights on ``device``, read once per process and device."""
    scorer = SurrogateScorer.load(directory)
    return scorer if device == "cpu" else scorer.to(torch.device(device))


def scorer_without_directory(layer: LayerKV) -> SurrogateScorer:
    """The scorer of a policy that names no directory, on ``layer``'s device: the served one. Raises
    ValueError naming ``vllm-kvevict calibrate`` when this process serves none. (The unit tests replace this
    function with random-weight scorers shaped like their layers: ``tests/learned_scorers.py``.)"""
    directory = served_scorer_dir()
    if directory is None:
        problem = served_scorer_problem() or (
            f"no scorer directory given and no served model; {CALIBRATE_HINT} (or pass scorer=DIR)"
        )
        raise ValueError(problem)
    return load_scorer(str(directory), str(layer.keys.device))
