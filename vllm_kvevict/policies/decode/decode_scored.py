"""The decode form of a prefill method whose scores need no queries (as kvpress's ``DecodingPress`` wraps any
press): at each re-score the prefill scorer judges the held entries of the layer from their cache rows.

The wrapped method scores each entry from its own row (``entry_scores``, e.g. ``KVzap``: the learned
scorer's prediction from the entry's key and value in this layer; ``StreamingLLM``: its position), so a held
entry scores the same whenever and however it is held, and a generated token is scored like a prompt token.
It keeps no state: nothing of a past re-score is needed. The wrapper builds a ``LayerKV`` of the held rows
(padding zeroed, their positions in ``key_positions``), masks padding to ``-inf`` and keeps the inner
method's sinks (positions ``< sinks``) and recent window (each head's newest ``window`` positions) at
``+inf``; top-k per head under the cap is the contract's, ragged Ada-KV caps come from the same scores
(``ada_caps``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from vllm_kvevict.policies.base import LayerKV, ScoredPolicy, check_fraction, reads_values
from vllm_kvevict.policies.decode.decode_policy import (
    DecodeEvictionPolicy,
    DecodeState,
    ada_caps,
    recent_entries,
)
from vllm_kvevict.policies.decode.held_layer import HeldLayer
from vllm_kvevict.policies.streamingllm import StreamingLLM


@runtime_checkable
class EntryScorer(Protocol):
    """A prefill method that scores each entry from its own cache row, with no queries and nothing forced
    (``entry_scores`` [kv_heads, n] float32), and always keeps its first ``sinks`` and, where it has a
    ``window``, its last ``window`` (StreamingLLM has none: the newest entries win by their score)."""

    sinks: int

    def entry_scores(self, layer: LayerKV) -> torch.Tensor: ...


@dataclass
class ScoredDecode(DecodeEvictionPolicy):
    """Score of a held entry = ``inner.entry_scores`` of its row in this layer; positions below
    ``inner.sinks`` and each head's newest ``inner.window`` positions (if any) are always kept. No queries, no
    state.

    inner: the prefill method (a ``ScoredPolicy`` that is an ``EntryScorer``: ``KVzap``, ``StreamingLLM``).
    alpha: None caps every head at the cap (or as the server's ``allocation`` says); a number in [0, 1]
        splits the layer's ``kv_heads x cap`` across heads by these scores, each head first keeping its best
        ``alpha x cap`` (Ada-KV's safeguard, ``ada_caps``), whatever ``allocation`` says.
    """

    inner: ScoredPolicy
    alpha: float | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if not isinstance(self.inner, ScoredPolicy) or not isinstance(self.inner, EntryScorer):
            raise ValueError(
                f"{owner} wraps a prefill ScoredPolicy that scores each entry from its own row with no "
                f"queries (entry_scores, sinks, window: KVzap); got {self.inner!r}"
            )
        if self.alpha is not None:
            check_fraction(owner, "alpha", self.alpha, 0.0, 1.0)

    @property
    def min_cap(self) -> int:
        return max(1, self.inner.min_budget)

    @property
    def reads_keys(self) -> bool:
        return getattr(self.inner, "reads_keys", True)

    @property
    def reads_values(self) -> bool:
        return reads_values(self.inner)

    def scores(self, state: DecodeState | None, held: HeldLayer) -> torch.Tensor:
        """[kv_heads, L] float32: the inner scores, ``+inf`` at sinks and window, ``-inf`` at padding."""
        valid = held.valid
        blank = ~valid[:, :, None]
        # Padding slots read whatever row the caller clamped them to: zeroed so they cannot poison a score.
        if self.reads_keys:
            keys = held.key_rows(self._label()).masked_fill(blank, 0)
        else:  # a scorer of positions alone: rows of width 0
            keys = torch.zeros(*held.positions.shape, 0, device=held.positions.device)
        values = held.value_rows(self._label()).masked_fill(blank, 0) if self.reads_values else None
        layer = LayerKV(
            keys, values, keys[:, :0], held.layer_idx, held.num_layers, key_positions=held.positions
        )
        scorer = self.inner
        assert isinstance(scorer, EntryScorer)
        scores = scorer.entry_scores(layer).to(device=valid.device, dtype=torch.float32)
        sinks = valid & (held.positions < scorer.sinks)
        forced = sinks | recent_entries(held.positions, getattr(scorer, "window", 0))
        return scores.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))

    def layer_caps(
        self, state: DecodeState | None, held: HeldLayer, cap: int, allocation: str
    ) -> int | torch.Tensor:
        if self.alpha is None:
            return super().layer_caps(state, held, cap, allocation)
        return ada_caps(self, state, held, cap, self.alpha)


@dataclass(frozen=True)
class DecodeForm:
    """A decode method that is ``ScoredDecode`` around prefill class ``inner`` (the registry's ``decode=``):
    its parameters are the inner's but ``dropped`` ones (a mode a decode cap cannot run, e.g. kvzap's
    threshold: the cap's count is known before the scores), plus ``alpha`` (default ``ada_alpha``) when
    ``ada``: Ada-KV caps."""

    inner: type
    ada: bool = False
    dropped: tuple[str, ...] = ()
    ada_alpha: float = 0.2

    def params(self) -> dict[str, Any]:
        inner = {f.name: f.default for f in dataclasses.fields(self.inner) if f.name not in self.dropped}
        return {**inner, "alpha": self.ada_alpha} if self.ada else inner

    def __call__(self, **params: Any) -> ScoredDecode:
        alpha = params.pop("alpha", self.ada_alpha) if self.ada else None
        return ScoredDecode(self.inner(**params), alpha)


#: StreamingLLM while decoding (Xiao et al., 2023): its prefill scorer wrapped, an entry's position being its
#: score; the first ``sinks`` positions and the newest ``cap - sinks`` entries, no queries, no state.
DecodeStreamingLLM = DecodeForm(StreamingLLM)
