"""What a request that asks for a learned method (``kvzap``, ``ada-kvzap``) may do, per request.

- No scorer: on a server whose model has no learned scorer (``policies/served_scorer.py``), a request
  asking for one is refused (HTTP 400) with the line that names ``vllm-kvevict calibrate``.
- Kept contexts (``kv_context: "keep"``) need every head and layer to keep the same count (one sub-block
  table per request, ``policies.base.keeps_equal_counts``); Ada-KV's per-head budgets are ragged. An
  ``ada-kvzap`` request that keeps a context runs as ``kvzap``: the same question-agnostic scores with a
  uniform per-head budget, which is the registered ``kvzap`` method itself (its name is what the request
  reports), and kvzap and ada-kvzap requests then share the entry (the same kept set). ``ada-snapkv`` and the
  other Ada methods are not switched to their uniform form: SnapKV's scores come from the prompt's last
  window, which for a kept context is the document's end, not the questions it will be asked; its kept
  contexts answered 0-1 of 8 needle questions against vanilla's 3 (docs/benchmarks.md, "Kept contexts"), and
  a silent switch would serve that under the default's name. Their 400 names the methods that keep one.
- Per-chunk eviction scores held entries again after every head kept its own: it needs a scorer whose heads
  score alone (``kvzap.scores_each_head_alone``); with any other the request is refused (400), the server at
  start-up.
"""

from __future__ import annotations

from typing import Any

from vllm_kvevict.policies import served_scorer
from vllm_kvevict.policies.base import EvictionPolicy
from vllm_kvevict.policies.kvzap import learned_part, scores_each_head_alone
from vllm_kvevict.policies.registry import available_methods

#: An Ada method -> the uniform method it keeps a context as (the same scores, every head the same count).
KEPT_CONTEXT_AS = {"ada-kvzap": "kvzap"}
#: Why the other Ada methods keep no context, as their 400 says it.
NO_FALLBACK = (
    "Ada-KV's per-head budgets are ragged; ada-kvzap keeps a context as kvzap, but ada-snapkv is not "
    "switched to snapkv, whose window scores judge a kept document by its end, not by its questions "
    '(docs/benchmarks.md, "Kept contexts")'
)


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
    directory = learned.scorer or served_scorer.served_scorer_dir()
    if directory is None or scores_each_head_alone(served_scorer.load_scorer(str(directory))):
        return None
    return (
        f"{method} with prefill=chunked: scorer {directory} scores each head from every head's row of a "
        "token, and between chunks each head holds its own tokens; evict whole prompts (prefill: whole) or "
        "fit a scorer whose heads score alone"
    )


def kept_context_method(method: str) -> str:
    """The method a request of ``method`` keeps a context with (``KEPT_CONTEXT_AS``, else itself)."""
    return KEPT_CONTEXT_AS.get(method, method)


def inherited_params(method: str, server_method: str, server_params: dict[str, Any]) -> dict[str, Any]:
    """The server's parameters a request keeping a context as ``method`` takes over from the server's Ada
    method (its scorer, window, sinks); none for any other pair."""
    if KEPT_CONTEXT_AS.get(server_method) != method:
        return {}
    accepted = next(info.params for info in available_methods() if info.name == method)
    return {key: value for key, value in server_params.items() if key in accepted}
