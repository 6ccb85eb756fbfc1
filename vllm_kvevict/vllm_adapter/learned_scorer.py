"""The start-up check of a server that evicts with a learned scorer (``kvzap``, ``ada-kvzap``).

Every vLLM process (API server, EngineCore, workers) runs it with its config through the plugin
(``plugin.install_eviction_if_configured``): it records the served model and its scorer
(``policies/served_scorer.py``) so all of them resolve a policy without a scorer directory alike, and it
refuses, in one line before any weight loads, a server whose method needs a scorer the model has none of,
that asks for the threshold mode, or that evicts chunk by chunk with a scorer whose heads do not score alone.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_kvevict.policies import served_scorer
from vllm_kvevict.policies.kvzap import learned_part
from vllm_kvevict.settings.learned_methods import chunked_problem

logger = logging.getLogger("vllm.kvevict")
_announced: set[str] = set()

#: Why the server refuses the threshold mode (the HF runner evicts with it).
THRESHOLD_REFUSAL = (
    "the scheduler sizes each request's blocks from its prompt length alone (layout/accounting.py), before "
    "any worker has scored an entry, and a threshold keeps a count only the scores decide; give the server a "
    "budget (--kv-budget), the HF runner measures the threshold mode"
)


def learned_scorer_refusal(vllm_config: Any) -> str | None:
    """One refusal line for a server whose learned method cannot run, else None (also with eviction off).
    Records the served model and scorer in this process either way."""
    from vllm_kvevict.settings.additional_config import get_eviction_config

    config = get_eviction_config(vllm_config)
    if config is None:
        return None
    model_config = vllm_config.model_config
    learned = learned_part(config.build_policy())
    name = str(getattr(model_config, "served_model_name", None) or model_config.model)
    problem = served_scorer.serve_model(
        model_config.hf_config, name, learned.scorer if learned is not None else None
    )
    if learned is None:
        return None  # a request may still ask for kvzap: it is refused per request (HTTP 400)
    if learned.threshold is not None:
        return f"kv eviction refused: {config.method} with threshold={learned.threshold}: {THRESHOLD_REFUSAL}"
    if problem is not None:
        return f"kv eviction refused: --kv-eviction {config.method}: {problem}"
    if config.chunked and (chunked := chunked_problem(config.method, learned)) is not None:
        return f"kv eviction refused: {chunked}"
    directory = str(learned.scorer or served_scorer.served_scorer_dir())
    if directory not in _announced:  # once per process: the check runs whenever a config is built
        _announced.add(directory)
        spec = served_scorer.load_scorer(directory).spec
        logger.info(
            "kv-eviction: %s scores with %s (%s, fitted on %s)",
            config.method,
            directory,
            spec.kind,
            spec.model_name,
        )
    return None
