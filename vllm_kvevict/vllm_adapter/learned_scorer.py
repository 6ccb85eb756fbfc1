"""The start-up check of a server that evicts with a learned scorer (``kvzap``, ``ada-kvzap``, as its prefill
method or as its decode-time method, ``--kv-decode-eviction kvzap``).

Every vLLM process (API server, EngineCore, workers) runs it with its config through the plugin
(``plugin.install_eviction_if_configured``): it records the served model and its scorer
(``policies/served_scorer.py``) so all of them resolve a policy without a scorer directory alike, and it
refuses, in one line before any weight loads, a server whose method needs a scorer the model has none of,
that asks for the threshold mode where it cannot be served (several workers, per-chunk eviction with a
per-layer budget), or that needs a scorer whose heads score alone and has another: one that scores held
entries again (chunk by chunk, or decode-time caps; after per-head eviction one cache row holds different
tokens in different heads) or that runs on several tensor-parallel ranks (each scores its own heads with its
slice of the scorer, ``serve_rank_heads``).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_kvevict.policies import served_scorer
from vllm_kvevict.policies.kvzap import KVzap, learned_part
from vllm_kvevict.policies.surrogate_scorer import model_fingerprint, scores_each_head_alone
from vllm_kvevict.settings.learned_methods import chunked_problem

logger = logging.getLogger("vllm.kvevict")
_announced: set[tuple[str, str]] = set()

def learned_scorer_refusal(vllm_config: Any) -> str | None:
    """One refusal line for a server whose learned method cannot run, else None (also with eviction off).
    Records the served model and scorer in this process either way."""
    from vllm_kvevict.settings.additional_config import get_eviction_config

    config = get_eviction_config(vllm_config)
    if config is None:
        return None
    model_config = vllm_config.model_config
    learned = learned_part(config.build_policy())
    decode = config.decode
    decoding = learned_part(decode.build_policy()) if decode is not None else None
    name = str(getattr(model_config, "served_model_name", None) or model_config.model)
    served = learned or decoding  # the prefill method's scorer is the served one when both are learned
    problem = served_scorer.serve_model(model_config.hf_config, name, served.scorer if served else None)
    if served is None:
        return None  # a request may still ask for kvzap: it is refused per request (HTTP 400)
    if learned is not None and learned.threshold is not None:
        refusal = threshold_problem(config.method, learned.threshold, vllm_config)
        if refusal is not None:
            return f"kv eviction refused: {refusal}"
    if problem is not None:
        decode_flag = f"--kv-decode-eviction {decode.method if decode is not None else ''}"
        flag = f"--kv-eviction {config.method}" if learned is not None else decode_flag
        return f"kv eviction refused: {flag}: {problem}"
    if learned is not None and learned.threshold_scope == "layer":
        directory = str(learned.scorer or served_scorer.served_scorer_dir())
        try:
            served_scorer.load_scorer(directory).spec.layer_level(0)
        except ValueError as exc:
            return f"kv eviction refused: {config.method} with threshold_scope=layer: {exc}"
    if learned is not None and config.chunked and (chunked := chunked_problem(config.method, learned)):
        return f"kv eviction refused: {chunked}"
    if learned is not None and (parallel := tensor_parallel_problem(config.method, learned, vllm_config)):
        return f"kv eviction refused: {parallel}"
    if decoding is not None and decode is not None:
        refusal = decode_problem(decode.method, decoding, model_config.hf_config, name)
        if refusal is not None:
            return f"kv eviction refused: {refusal}"
        announce(f"decode {decode.method}", decoding)
    if learned is not None:
        announce(config.method, learned)
    return None


def threshold_problem(method: str, threshold: float, vllm_config: Any) -> str | None:
    """Why the threshold mode (a kept count the scores set, the budget its ceiling) cannot be served with
    this configuration, else None: the worker reports each request's kept bound on the step's output,
    which reaches the scheduler from one worker only. (A decode-time cap then follows the rule of the
    reported bound on both sides: ``DecodeSchedule.start_from``.)"""
    parallel = getattr(vllm_config, "parallel_config", None)
    workers = getattr(parallel, "tensor_parallel_size", 1) * getattr(parallel, "pipeline_parallel_size", 1)
    if workers > 1:
        return (
            f"{method} with threshold={threshold}: each of the {workers} workers keeps its own heads' "
            "count and only one worker's report reaches the scheduler; serve it on one GPU (tensor and "
            "pipeline parallel size 1) or give a fixed budget (drop the threshold)"
        )
    return None


def tensor_parallel_problem(method: str, learned: KVzap, vllm_config: Any) -> str | None:
    """Why ``learned``'s scorer cannot score on this server's tensor-parallel ranks, else None: each rank
    holds its own KV heads and scores them with its slice of the scorer (``served_scorer.for_layer_heads``),
    which exists only for a scorer whose heads score alone."""
    ranks = tensor_parallel_ranks(vllm_config)
    directory = learned.scorer or served_scorer.served_scorer_dir()
    if ranks == 1 or directory is None or scores_each_head_alone(served_scorer.load_scorer(str(directory))):
        return None
    return (
        f"{method} on {ranks} tensor-parallel ranks: scorer {directory} scores each head from every head's "
        "row, and each rank holds only its own KV heads; fit one whose heads score alone (calibrate "
        "without --heads joint) or serve it with --tensor-parallel-size 1"
    )


def tensor_parallel_ranks(vllm_config: Any) -> int:
    """The server's tensor-parallel size (1 where its config says none)."""
    return getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1


def rank_heads(total: int, local: int, rank: int, ranks: int) -> tuple[int, int]:
    """(first, count) of the model's ``total`` KV heads that tensor-parallel ``rank`` of ``ranks`` holds
    (``local`` of them): consecutive slices, or with more ranks than heads each head replicated on
    ``ranks / total`` consecutive ranks (vLLM's split of KV heads)."""
    first = rank * local if ranks <= total else rank * total // ranks
    return first, local


def serve_rank_heads(vllm_config: Any, local_heads: int) -> None:
    """Record which of the model's KV heads this worker process holds (``served_scorer.serve_heads``), so
    a learned scorer fitted on all of them scores this rank's with its slice for them."""
    ranks = tensor_parallel_ranks(vllm_config)
    if ranks == 1:
        return  # every head: the scorer as it is
    from vllm.distributed import get_tensor_model_parallel_rank

    total = vllm_config.model_config.get_total_num_kv_heads()
    first, count = rank_heads(total, local_heads, get_tensor_model_parallel_rank(), ranks)
    served_scorer.serve_heads(first, count, total)


def decode_problem(method: str, learned: KVzap, hf_config: Any, model_name: str) -> str | None:
    """Why decode method ``method`` cannot cap decoding with ``learned``'s scorer, else None: a directory of
    its own that does not fit the model, or a scorer whose heads do not score alone (each head holds its own
    entries at a re-score, so a scorer reading every head's row would score an entry by other tokens)."""
    directory = learned.scorer or served_scorer.served_scorer_dir()
    if directory is None:
        return f"--kv-decode-eviction {method}: {served_scorer.served_scorer_problem()}"
    try:
        scorer = served_scorer.load_scorer(str(directory))
    except ValueError as exc:
        return f"--kv-decode-eviction {method}: {exc}"
    mismatch = scorer.mismatch(model_fingerprint(hf_config))
    if mismatch is not None:
        return (
            f"--kv-decode-eviction {method}: scorer {directory} cannot score {model_name}: {mismatch}; "
            f"{served_scorer.CALIBRATE_HINT}"
        )
    if not scores_each_head_alone(scorer):
        return (
            f"--kv-decode-eviction {method}: scorer {directory} scores each head from every head's row of a "
            "token, and at a decode-time re-score each head holds its own tokens; fit a scorer whose heads "
            "score alone (calibrate --heads separate, the default)"
        )
    return None


def announce(method: str, learned: KVzap) -> None:
    """Log once per process and scorer which scorer ``method`` scores with."""
    directory = str(learned.scorer or served_scorer.served_scorer_dir())
    if (method, directory) in _announced:  # the check runs whenever a config is built
        return
    _announced.add((method, directory))
    spec = served_scorer.load_scorer(directory).spec
    logger.info(
        "kv-eviction: %s scores with %s (%s, fitted on %s)", method, directory, spec.kind, spec.model_name
    )
