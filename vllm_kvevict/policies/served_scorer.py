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

from vllm_kvevict.policies.surrogate_scorer import (
    SurrogateScorer,
    find_packaged_scorer,
    model_fingerprint,
    scorer_for_heads,
)

if TYPE_CHECKING:
    from vllm_kvevict.policies.base import LayerKV

#: How a server is told which scorer to use, as every refusal says it.
CALIBRATE_HINT = (
    "fit one with `vllm-kvevict calibrate MODEL --out DIR` and start the server with "
    '--kv-eviction-config \'{"scorer": "DIR"}\''
)

_served: dict[str, object] = {"model": None, "directory": None, "heads": None}


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
    _served.update(model=None, directory=None, heads=None)


def serve_heads(first: int, count: int, total: int) -> None:
    """This process holds KV heads ``[first, first + count)`` of the model's ``total`` (a tensor-parallel
    rank's, ``vllm_adapter/evicting_backend.py``): a scorer fitted on all of them scores these with its
    slice for them (``for_layer_heads``)."""
    if not 0 <= first < first + count <= total:
        raise ValueError(f"heads [{first}, {first + count}) are not heads of a {total}-head model")
    _served["heads"] = None if count == total else (first, count, total)


def for_layer_heads(scorer: SurrogateScorer, num_kv_heads: int) -> SurrogateScorer:
    """``scorer`` for a layer of ``num_kv_heads`` KV heads: itself, or on a tensor-parallel rank holding
    those of the model's heads its slice for them (``scorer_for_heads``, made once per scorer)."""
    heads = _served["heads"]
    if not isinstance(heads, tuple) or scorer.spec.num_kv_heads == num_kv_heads:
        return scorer
    first, count, total = heads
    if (count, total) != (num_kv_heads, scorer.spec.num_kv_heads):
        return scorer  # not this rank's layout: the caller's shape check names the mismatch
    key = (id(scorer), first, count)
    if key not in _rank_scorers:
        _rank_scorers[key] = (scorer, scorer_for_heads(scorer, first, count))  # keeps the key's id alive
    return _rank_scorers[key][1]


#: (id of a whole scorer, first head, head count) -> (that scorer, its slice for those heads)
_rank_scorers: dict[tuple[int, int, int], tuple[SurrogateScorer, SurrogateScorer]] = {}


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
