"""What a request that asks for a learned method (``kvzap``, ``ada-kvzap``) may do, per request.

- No scorer: on a server whose model has no learned scorer (``policies/served_scorer.py``), a request
  asking for one is refused (HTTP 400) with the line that names ``vllm-kvevict calibrate``.
- Kept contexts (``kv_context: "keep"``) are judged before any question is asked. Every head of every
  layer then keeps whole sub-blocks (``EvictionPolicy.kept_context_form``: Ada-KV's head budgets in whole
  blocks). The served default ``ada-snapkv`` keeps a context as ``ada-kvzap`` where the served model has a
  learned scorer (``KEPT_CONTEXT_AS``): SnapKV's window would judge the document by its end, not by the
  questions it will be asked (docs/benchmarks.md, "Kept contexts"); the request reports ``ada-kvzap`` and
  shares the entry with ``ada-kvzap`` keepers. Without a scorer it keeps the context as itself.
- Per-chunk eviction scores held entries again after every head kept its own: it needs a scorer whose heads
  score alone (``scores_each_head_alone``); with any other the request is refused (400), the server at
  start-up. The threshold mode per layer evicts whole prompts only (every head holds the count a budget sets
  between chunks). Pooled across layers (``budget_scope: "model"``) it is evicted per chunk too: between
  chunks the ranking keeps the entries above the threshold, at most the rule's ``L·H·a(n)``, after the last
  chunk those above it under the ceiling (``ChunkEviction._ranked_work``, ranked by ``AcrossLayers``).
"""

from __future__ import annotations

from typing import Any

from vllm_kvevict.policies import served_scorer
from vllm_kvevict.policies.base import EvictionPolicy
from vllm_kvevict.policies.kvzap import learned_part
from vllm_kvevict.policies.registry import available_methods
from vllm_kvevict.policies.surrogate_scorer import scores_each_head_alone

#: A method -> the question-agnostic method it keeps a context as, where the served model has a scorer.
KEPT_CONTEXT_AS = {"ada-snapkv": "ada-kvzap"}


def learned_method_problem(method: str, policy: EvictionPolicy) -> str | None:
    """Why ``method`` (built as ``policy``) cannot run per request in this process, else None."""
    learned = learned_part(policy)
    if learned is None or learned.scorer is not None:
        return None
    problem = served_scorer.served_scorer_problem()
    return None if problem is None else f"{method} needs a learned scorer: {problem}"


def chunked_problem(method: str, policy: EvictionPolicy) -> str | None:
    """Why ``method`` cannot evict a prompt chunk by chunk here (its scorer reads every head's row of a
    token, which per-head eviction leaves holding different tokens), else None."""
    learned = learned_part(policy)
    if learned is None:
        return None
    if learned.threshold is not None and not learned.pools_layers:
        return (
            f"{method} with prefill=chunked and threshold={learned.threshold}: between chunks every head "
            "holds a count the budget sets, and a threshold keeps what the whole prompt's scores decide; "
            "evict whole prompts (prefill: whole), pool the budget (budget_scope: model) or drop the "
            "threshold"
        )
    directory = learned.scorer or served_scorer.served_scorer_dir()
    if directory is None or scores_each_head_alone(served_scorer.load_scorer(str(directory))):
        return None
    return (
        f"{method} with prefill=chunked: scorer {directory} scores each head from every head's row of a "
        "token, and between chunks each head holds its own tokens; evict whole prompts (prefill: whole) or "
        "fit a scorer whose heads score alone"
    )


def kept_context_method(method: str) -> str:
    """The method a request of ``method`` keeps a context with: ``KEPT_CONTEXT_AS``'s where this process
    serves a learned scorer, else itself."""
    learned = KEPT_CONTEXT_AS.get(method)
    return method if learned is None or served_scorer.served_scorer_dir() is None else learned


def inherited_params(method: str, server_method: str, server_params: dict[str, Any]) -> dict[str, Any]:
    """The server's parameters a request keeping a context as ``method`` takes over from the server's
    method (those ``method`` accepts: its window, Ada-KV's alpha); none for any other pair."""
    if KEPT_CONTEXT_AS.get(server_method) != method:
        return {}
    accepted = next(info.params for info in available_methods() if info.name == method)
    return {key: value for key, value in server_params.items() if key in accepted}
