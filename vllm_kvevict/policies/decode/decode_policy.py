"""The contract of a decode-time eviction method, and what every method shares.

A re-score happens every ``interval`` generated tokens, once per (request, layer): the caller passes what the
layer holds as one ``HeldLayer`` (per KV head, padded: positions, and the keys and values a method reads,
``reads_keys``/``reads_values``; the layer index) and the recent queries it kept for the method
(``query_window`` of them). ``observe`` folds their attention into the method's running per-entry state;
``select`` answers which held entries each KV head keeps, at most ``cap`` of them; the caller compacts its
cache with the answer and calls ``state.keep`` with the same indices.

Layout: slot i of head h of the state describes ``held.keys[h, i]``. After ``keep(kept)`` slot i holds the
entry that was at slot ``kept[h, i]``. A slot whose position differs from the state's (a new token, or
padding that became a token) starts with zero statistics, so the caller may append new tokens after each
head's kept entries or after the common width, as it likes. Pure torch, no vLLM import; no per-head Python
loops.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from vllm_kvevict.policies.decode.held_layer import HeldLayer
from vllm_kvevict.policies.kept_masks import ada_allocation, top_k_mask

#: Elements of one attention block [q_heads, T, L] computed at once (bounds observe's memory).
_ATTENTION_BLOCK = 1 << 24


class DecodeState(ABC):
    """Per (request, layer) running state of a method; slot-aligned with the caller's held entries.

    positions: [kv_heads, L] int64, the token position each slot described at the last call (-1: none).
    """

    positions: torch.Tensor

    def align(self, key_positions: torch.Tensor) -> torch.Tensor:
        """Fit the state to the caller's slots ``key_positions`` [kv_heads, L]; returns [kv_heads, L] bool,
        True where a slot's entry is not the one the state described (its statistics must start at zero)."""
        old = fit_width(self.positions, key_positions.shape[1], -1)
        changed = old != key_positions
        self.positions = key_positions.clone()
        return changed

    @abstractmethod
    def keep(self, kept_indices: torch.Tensor) -> None:
        """Compact to the kept slots, kept_indices: [kv_heads, M] int64 sorted ascending, -1 padded."""

    def keep_positions(self, kept_indices: torch.Tensor) -> None:
        self.positions = gather_padded(self.positions, kept_indices, -1)


class DecodeEvictionPolicy(ABC):
    """One decode-time method. Subclasses define ``scores`` (and, for stateful methods, ``init_state`` and
    ``observe``); top-k per head, caps and compaction live here once."""

    #: user-facing name, set by the registry.
    name: str = ""

    @property
    def query_window(self) -> int:
        """How many recent queries per (request, layer) the caller keeps and passes to ``observe``."""
        return 0

    @property
    def min_cap(self) -> int:
        """Smallest per-head cap: the entries the method always keeps (sinks, recent window)."""
        return 1

    @property
    def reads_keys(self) -> bool:
        """Whether ``HeldLayer.keys`` must be read from the cache (the attention methods read them)."""
        return self.query_window > 0

    @property
    def reads_values(self) -> bool:
        """Whether ``HeldLayer.values`` must be read from the cache (a scorer of whole cache rows)."""
        return False

    def queries_needed(self, interval: int) -> int:
        """Recent queries to pass when re-scoring every ``interval`` tokens (at most ``query_window``)."""
        return self.query_window

    def check_interval(self, interval: int) -> None:
        """Raise ValueError when re-scoring every ``interval`` tokens loses queries the method needs."""
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{self._label()}: interval={interval!r} must be an int >= 1")

    def init_state(self, num_kv_heads: int, device: torch.device | str) -> DecodeState | None:
        """A fresh state for one (request, layer), or None for a method without one."""
        return None

    def observe(
        self,
        state: DecodeState | None,
        held: HeldLayer,
        queries: torch.Tensor,
        query_positions: torch.Tensor,
    ) -> DecodeState | None:
        """Fold the attention of ``queries`` over the held entries into ``state``.

        held: the layer's entries (``held.keys`` [kv_heads, L, d], ``held.positions`` [kv_heads, L] int64,
        -1 = padding); queries: [q_heads, T, d] (q_heads a multiple of kv_heads); query_positions: [T] int64
        (-1 = an unfilled ring slot). Queries see the entries at positions <= theirs (causal), softmax over
        the held ones.
        """
        return state

    @abstractmethod
    def scores(self, state: DecodeState | None, held: HeldLayer) -> torch.Tensor:
        """[kv_heads, L] float32 importance of the held entries, ``+inf`` for the ones always kept."""

    def keep_mask(self, state: DecodeState | None, held: HeldLayer, caps: torch.Tensor) -> torch.Tensor:
        """[kv_heads, L] bool, at most caps[h] held entries of head h (its best scores)."""
        return top_k_mask(self.scores(state, held), caps, eligible=held.valid)

    def select(
        self, state: DecodeState | None, held: HeldLayer, cap: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Which held entries each KV head keeps.

        held: the layer's entries (positions [kv_heads, L], -1 = padding); cap: per-head cap, an int or
        [kv_heads] int (ragged, e.g. from ``layer_caps``). Returns (kept_indices [kv_heads, M] int64 slot
        indices sorted ascending, -1 padded, M = min(L, max cap); new_lengths [kv_heads] int64 <= cap).
        """
        kv_heads, length = held.positions.shape
        caps, width = self._caps(cap, kv_heads, length, held.positions.device)
        keep = self.keep_mask(state, held, caps)
        return kept_slots(keep, width)

    def layer_caps(
        self, state: DecodeState | None, held: HeldLayer, cap: int, allocation: str
    ) -> int | torch.Tensor:
        """The per-head caps of one re-score: ``cap`` for every head (``allocation`` "uniform"), or Ada-KV's
        ragged caps summing to at most ``kv_heads * cap`` ("ada", ``ada_caps``)."""
        return ada_caps(self, state, held, cap) if allocation == "ada" else cap

    def _caps(
        self, cap: int | torch.Tensor, kv_heads: int, length: int, device: torch.device
    ) -> tuple[torch.Tensor, int]:
        if isinstance(cap, torch.Tensor):
            if cap.shape != (kv_heads,):
                raise ValueError(f"{self._label()}: cap tensor must be [{kv_heads}]; got {tuple(cap.shape)}")
            caps = cap.to(device=device, dtype=torch.int64)
            return caps, min(length, int(caps.max()) if kv_heads else 0)
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < self.min_cap:
            raise ValueError(
                f"{self._label()}: cap={cap!r} is not valid; it must be an int >= {self.min_cap} "
                "(the entries the method always keeps) or a [kv_heads] tensor"
            )
        return torch.full((kv_heads,), cap, dtype=torch.int64, device=device), min(length, cap)

    def _label(self) -> str:
        return self.name or type(self).__name__


def kept_slots(keep: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept_indices [kv_heads, width] sorted ascending, -1 padded; lengths [kv_heads]) of a mask
    ``keep`` [kv_heads, L] with at most ``width`` True entries per row."""
    kv_heads, length = keep.shape
    slots = torch.arange(length, device=keep.device).expand(kv_heads, length)
    # Dropped slots sort after every kept one, so each row starts with its kept slots ascending.
    ordered = torch.where(keep, slots, length).sort(dim=1).values[:, :width]
    return torch.where(ordered == length, -1, ordered), keep.sum(dim=1)


def gather_padded(values: torch.Tensor, indices: torch.Tensor, fill: float) -> torch.Tensor:
    """values[h, indices[h, i]] per row, ``fill`` where indices is -1: [kv_heads, M]."""
    picked = values.gather(1, indices.clamp(min=0))
    return torch.where(indices >= 0, picked, fill)


def fit_width(values: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """values [rows, n] cut or padded with ``fill`` at the end to [rows, width]."""
    if values.shape[1] >= width:
        return values[:, :width]
    return torch.nn.functional.pad(values, (0, width - values.shape[1]), value=fill)


def recent_entries(key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[kv_heads, L] bool: the held entries among the last ``window`` positions of each head."""
    newest = key_positions.amax(dim=1, keepdim=True)
    return (key_positions >= 0) & (key_positions > newest - window)


def held_attention(
    keys: torch.Tensor, key_positions: torch.Tensor, queries: torch.Tensor, query_positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the queries over the held entries, per query head.

    keys: [kv_heads, L, d]; key_positions: [kv_heads, L] (-1 = padding); queries: [q_heads, T, d];
    query_positions: [T] (-1 = no query). Query head j reads KV head j // g (g = q_heads // kv_heads),
    grouped so KV is never repeated. Returns (probs [kv_heads, g, T, L] float32, zero where not visible
    and for absent queries; visible [kv_heads, T, L] bool).
    """
    kv_heads, length, d = keys.shape
    q_heads, num_queries, _ = queries.shape
    if q_heads % kv_heads != 0 or queries.shape[2] != d:
        raise ValueError(
            f"queries must be [q_heads, T, {d}] with q_heads a multiple of kv_heads={kv_heads}; "
            f"got {tuple(queries.shape)}"
        )
    if key_positions.shape != (kv_heads, length) or query_positions.shape != (num_queries,):
        raise ValueError(
            f"key_positions must be [{kv_heads}, {length}] and query_positions [{num_queries}]; got "
            f"{tuple(key_positions.shape)} and {tuple(query_positions.shape)}"
        )
    group = q_heads // kv_heads
    query_positions = query_positions.to(device=keys.device, dtype=torch.int64)
    visible = (key_positions[:, None, :] >= 0) & (key_positions[:, None, :] <= query_positions[None, :, None])
    visible &= (query_positions >= 0)[None, :, None]
    keys32 = keys.float()
    grouped = queries.float().reshape(kv_heads, group, num_queries, d)
    probs = torch.empty(kv_heads, group, num_queries, length, device=keys.device)
    step = max(1, _ATTENTION_BLOCK // max(1, q_heads * length))
    for start in range(0, num_queries, step):
        block = grouped[:, :, start : start + step]
        logits = torch.einsum("kgtd,kld->kgtl", block, keys32) / math.sqrt(d)
        mask = visible[:, None, start : start + step]
        logits = logits.masked_fill(~mask, float("-inf"))
        # A query that sees nothing (absent) would be all -inf: its row is zero, not NaN.
        probs[:, :, start : start + step] = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return probs, visible


def ada_caps(
    policy: DecodeEvictionPolicy,
    state: DecodeState | None,
    held: HeldLayer,
    cap: int,
    alpha: float = 0.2,
) -> torch.Tensor:
    """Ada-KV ragged caps for one layer: [kv_heads] int64 summing to at most ``kv_heads * cap``.

    Each head first gets its best ``alpha * cap`` entries (the safeguard) and its always-kept ones; the
    rest of the layer's ``kv_heads * cap`` slots go to the highest scores of all heads together
    (``selection.ada_allocation``, as Ada-KV does after prefill). A head never gets more than it holds.
    """
    if cap >= held.width:
        return held.valid.sum(dim=1)
    return ada_caps_from_scores(policy.scores(state, held), held.positions, cap, alpha)


def ada_caps_from_scores(
    scores: torch.Tensor, key_positions: torch.Tensor, cap: int, alpha: float
) -> torch.Tensor:
    """``ada_caps`` of one layer from its scores [kv_heads, L] (``policy.scores``): [kv_heads] int64."""
    valid = key_positions >= 0
    if cap >= key_positions.shape[1]:
        return valid.sum(dim=1)
    scores = torch.where(valid, scores, float("-inf"))
    return (ada_allocation(scores, cap, alpha) & valid).sum(dim=1)
