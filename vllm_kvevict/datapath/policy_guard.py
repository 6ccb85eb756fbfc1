"""Fault containment at the policy boundary of the worker.

``guarded_select`` calls a policy's ``select`` for one layer of one request and turns every way it can go
wrong into a :class:`PolicyFault`: an exception of any type (``raised``), NaN scores (``nan_scores``), or kept
tokens that break the block accounting — not exactly ``H x budget`` in total, a head over the prompt, an index
outside the prompt or repeated (``wrong_counts``). Each fault is counted in
``vllm_kvevict_policy_fallbacks_total{method, reason}`` and raised as a ``RuntimeError``, which
``kept_selection.kept_or_newest`` logs and answers with the layer's most recent tokens: the scheduler frees
the request's blocks whatever happens, so the request must still compact, and the other requests of the
batch are not touched. Prefill policies (``guarded_select``) and decode-time ones (``guarded``, from
``decode_rescore.DecodeChoice``) go through the same guard.

Test hook: ``KVEVICT_FAULT_INJECTION='{"raise": 777, "wrong_counts": 778, "nan": 779}'`` injects each fault
into every layer of the requests whose prompt has exactly that many tokens (read once per process; off unless
set). ``raise`` injects an ``IndexError``, a type the worker did not catch before this guard existed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from vllm_kvevict import metrics
from vllm_kvevict.policies.base import EvictionPolicy, KeptTokens, LayerKV, ScoredPolicy
from vllm_kvevict.policies.decode.decode_policy import DecodeEvictionPolicy
from vllm_kvevict.policies.decode.held_layer import HeldLayer

FAULT_INJECTION_ENV = "KVEVICT_FAULT_INJECTION"
INJECTABLE = ("raise", "wrong_counts", "nan")

#: what a guarded call returns (kept entries, or a layer's scores)
Chosen = TypeVar("Chosen")


class PolicyFault(RuntimeError):
    """A policy failed on one layer of one request; ``reason`` is one of ``metrics.FALLBACK_REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class NaNScores(RuntimeError):
    """A scorer returned NaN for some (head, token)."""


def guarded_select(policy: EvictionPolicy, layer: LayerKV, budget: int, fixed: int = 0) -> KeptTokens:
    """``policy.select(layer, budget)`` (``select_after`` tokens ``[0, fixed)`` of a shared prefix),
    validated; raises :class:`PolicyFault` (counted) on any failure."""
    injected = injected_faults().get(layer.num_tokens)

    def select() -> KeptTokens:
        if injected == "raise":
            raise IndexError(f"injected ({FAULT_INJECTION_ENV}) for a {layer.num_tokens}-token prompt")
        kept = policy.select_after(layer, budget, fixed) if fixed else policy.select(layer, budget)
        if injected == "wrong_counts":
            kept = KeptTokens(indices=kept.indices, counts=kept.counts + 1)
        return kept

    at_most = bool(getattr(policy, "adapts_kept_count", False))
    return guarded(
        policy,
        select,
        lambda kept: accounting_problem(kept, layer, budget, fixed, at_most),
        poison=injected == "nan",
    )


def guarded_scores(policy: ScoredPolicy, layer: LayerKV, budget: int, own_rows: bool = False) -> torch.Tensor:
    """``policy.score(layer, budget)`` [H, n] (``+inf``: always kept), NaN-checked and of the layer's shape
    (a budget pooled across layers ranks the scores themselves); raises :class:`PolicyFault` (counted) on
    any failure. ``own_rows``: each entry's score from its own cache row alone, none forced by its index
    (``KVzap.entry_scores``: held entries of several chunks, whose caller forces by position). Fault
    injection as ``guarded_select`` ("raise", "nan")."""
    injected = injected_faults().get(layer.num_tokens)
    shape = (layer.num_kv_heads, layer.num_tokens)

    def score() -> torch.Tensor:
        if injected == "raise":
            raise IndexError(f"injected ({FAULT_INJECTION_ENV}) for a {layer.num_tokens}-token prompt")
        return policy.entry_scores(layer) if own_rows else policy.score(layer, budget)  # type: ignore[attr-defined]

    def problem(scores: torch.Tensor) -> str | None:
        found = tuple(scores.shape)
        return None if found == shape else f"scores of shape {found}, the layer has {shape}"

    return guarded(policy, score, problem, poison=injected == "nan")


def guarded(
    policy: object,
    select: Callable[[], Chosen],
    problem_of: Callable[[Chosen], str | None],
    poison: bool = False,
) -> Chosen:
    """The one guard of every mode: ``select()`` with ``policy``'s scorers NaN-checked, its answer checked
    by ``problem_of`` (None: it fits the accounting); raises :class:`PolicyFault` (counted) on any failure."""
    try:
        with nan_checked_scores(policy, poison=poison):
            kept = select()
    except NaNScores as exc:
        raise fault(policy, "nan_scores", str(exc)) from exc
    except Exception as exc:  # any bug in any policy: contained here, never in vLLM's engine loop
        raise fault(policy, "raised", f"{type(exc).__name__}: {exc}") from exc
    problem = problem_of(kept)
    if problem is not None:
        raise fault(policy, "wrong_counts", problem)
    return kept


def policy_label(policy: object) -> str:
    """The method name a fault is counted under (the class name of an unnamed policy)."""
    return getattr(policy, "name", "") or type(policy).__name__


def fault(policy: object, reason: str, message: str) -> PolicyFault:
    metrics.record_policy_fallback(policy_label(policy), reason)
    return PolicyFault(reason, message)


def accounting_problem(
    kept: KeptTokens, layer: LayerKV, budget: int, fixed: int = 0, at_most: bool = False
) -> str | None:
    """Why ``kept`` cannot be written into the blocks the scheduler leaves, or None when it can (kept
    indices must lie in ``[fixed, n)``: the shared prefix is not the request's to place). ``at_most``: the
    policy's scores set the count (an adaptive plan), at most H x ``budget``."""
    heads, n = layer.num_kv_heads, layer.num_tokens - fixed
    counts, indices = kept.counts, kept.indices
    if tuple(counts.shape) != (heads,) or indices.dim() != 2 or indices.shape[0] != heads:
        return f"counts {tuple(counts.shape)} / indices {tuple(indices.shape)} are not per KV head ({heads})"
    most = min(n, indices.shape[1])
    total = int(counts.sum())
    wrong_total = total > heads * budget if at_most else total != heads * budget
    if wrong_total or int(counts.min()) < 0 or int(counts.max()) > most:
        needs = f"at most {budget}" if at_most else str(budget)
        return f"kept {counts.tolist()} tokens per head; needs {needs} per head on average, <= {n} each"
    valid = torch.arange(indices.shape[1], device=indices.device) < counts[:, None]
    chosen = indices[valid]
    if chosen.numel() and (int(chosen.min()) < fixed or int(chosen.max()) >= fixed + n):
        after = f" after its {fixed} shared tokens" if fixed else ""
        return f"kept indices outside the {n}-token prompt{after}"
    rising = indices[:, 1:] > indices[:, :-1]
    if bool((~rising & valid[:, 1:]).any()):
        return "kept indices of a head are not ascending and unique"
    return None


@contextlib.contextmanager
def nan_checked_scores(policy: object, poison: bool = False) -> Iterator[None]:
    """Within the block, every scorer of ``policy`` (itself and the ``inner`` policies it wraps: a prefill
    policy's ``score``, a decode policy's ``scores``) raises :class:`NaNScores` on NaN scores; ``poison``
    turns its scores into NaN first (fault injection)."""
    scorers: list[tuple[object, str]] = []
    current: object = policy
    while isinstance(current, EvictionPolicy | DecodeEvictionPolicy):
        if isinstance(current, ScoredPolicy):
            scorers.append((current, "score"))
        elif isinstance(current, DecodeEvictionPolicy):
            scorers.append((current, "scores"))
        current = getattr(current, "inner", None)
    for scorer, method in scorers:
        # Instance attribute over the class method, removed on exit; policies are frozen dataclasses.
        object.__setattr__(scorer, method, checked_score(scorer, method, poison))
    try:
        yield
    finally:
        for scorer, method in scorers:
            object.__delattr__(scorer, method)


def checked_score(scorer: object, method: str, poison: bool) -> Callable[..., torch.Tensor]:
    score = getattr(type(scorer), method).__get__(scorer)

    def score_checked(*args: object) -> torch.Tensor:
        scores = score(*args)
        if poison:
            scores = torch.full_like(scores, float("nan"))
        if bool(torch.isnan(scores).any()):
            # A prefill scorer's LayerKV or a decode method's HeldLayer names the layer.
            layer = next((arg.layer_idx for arg in args if isinstance(arg, LayerKV | HeldLayer)), "?")
            raise NaNScores(f"{policy_label(scorer)} scored NaN in layer {layer}")
        return scores

    return score_checked


@functools.cache
def injected_faults() -> dict[int, str]:
    """{prompt tokens: fault} from ``KVEVICT_FAULT_INJECTION`` (empty when unset)."""
    text = os.environ.get(FAULT_INJECTION_ENV)
    if not text:
        return {}
    spec = json.loads(text)
    unknown = set(spec) - set(INJECTABLE)
    if unknown:
        valid = ", ".join(INJECTABLE)
        raise ValueError(f"{FAULT_INJECTION_ENV}: unknown faults {sorted(unknown)}; valid: {valid}")
    return {int(tokens): name for name, tokens in spec.items()}
