"""The contract every eviction policy fulfils. Pure torch, no vLLM import.

A policy sees one attention layer of one request at a time and answers: which prompt tokens does each KV
head keep? The caller (the vLLM adapter, the kvpress parity tests, the HF quality report) owns memory.
"""

from __future__ import annotations

import dataclasses
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from vllm_kvevict.policies.kept_masks import top_k_mask

if TYPE_CHECKING:
    from vllm_kvevict.policies.query_statistics import QueryStatistics


@dataclass(frozen=True)
class LayerKV:
    """One layer's prompt cache and the queries that judge it.

    keys:    [kv_heads, n, d] post-RoPE keys of the n prompt tokens.
    values:  [kv_heads, n, d] values of the same tokens, or None when the caller left them out for a policy
             that reads none (``reads_values``); ``value_rows`` hands them to the methods that do.
    queries: [q_heads, w, d] post-RoPE queries of the observation window (the last w prompt positions) or
             of proxy tokens; q_heads is a multiple of kv_heads (GQA group = q_heads // kv_heads, query head
             j belongs to KV head j // group).
    query_positions: [w] token positions (0-based, < n) of those queries, for the causal mask; None means
             the last w positions n-w .. n-1.
    layer_idx, num_layers: where this layer sits (PyramidKV budgets, per-layer seeds).
    o_proj: [hidden, q_heads * d] this layer's o_proj weight (CriticalKV), or None.
    rope_inv_freq: [r / 2] this layer's RoPE inverse frequencies (NeoX rotate-half layout on the first r
             coordinates of a head), or None; Expected Attention takes RoPE out of the queries with it.
    query_statistics: the running pre-RoPE query statistics of every prompt query so far, carried across
             chunks by the caller (``expected_attention.QueryStatistics``), or None (then computed from
             ``queries`` by the methods that use them).
    key_positions: [kv_heads, n] int64 token positions of the entries when they are not 0 .. n-1 (the held
             entries of a decode-time re-score, ``ScoredDecode``), or None.
    """

    keys: torch.Tensor
    values: torch.Tensor | None
    queries: torch.Tensor
    layer_idx: int = 0
    num_layers: int = 1
    query_positions: torch.Tensor | None = None
    o_proj: torch.Tensor | None = None
    rope_inv_freq: torch.Tensor | None = None
    query_statistics: QueryStatistics | None = None
    key_positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        values_shape = self.keys.shape if self.values is None else self.values.shape
        if self.keys.dim() != 3 or values_shape != self.keys.shape:
            raise ValueError(
                f"keys and values must both be [kv_heads, n, d]; got keys {tuple(self.keys.shape)}, "
                f"values {tuple(values_shape)}"
            )
        if self.queries.dim() != 3 or self.queries.shape[2] != self.keys.shape[2]:
            raise ValueError(
                f"queries must be [q_heads, w, d] with d = {self.keys.shape[2]}; "
                f"got {tuple(self.queries.shape)}"
            )
        if self.queries.shape[0] % self.keys.shape[0] != 0:
            raise ValueError(
                f"q_heads={self.queries.shape[0]} must be a multiple of kv_heads={self.keys.shape[0]}"
            )
        if not 0 <= self.layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={self.layer_idx} must be in [0, num_layers={self.num_layers})")

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[0]

    def value_rows(self, owner: str) -> torch.Tensor:
        """[kv_heads, n, d] ``values``; raises ValueError when the caller left them out (``owner`` reads
        values, so its class must keep ``reads_own_values`` True)."""
        if self.values is None:
            raise ValueError(f"{owner} reads the layer's values, but the caller left them out")
        return self.values

    def values_slice(self, start: int, end: int | None = None) -> torch.Tensor | None:
        """``values[:, start:end]``, or None when the caller left them out."""
        return None if self.values is None else self.values[:, start:end]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    @property
    def group_size(self) -> int:
        return self.queries.shape[0] // self.keys.shape[0]

    def positions(self) -> torch.Tensor:
        """[w] int64 positions of the queries (the last w prompt positions when not given)."""
        if self.query_positions is not None:
            return self.query_positions.to(device=self.keys.device, dtype=torch.int64)
        w = self.queries.shape[1]
        return torch.arange(self.num_tokens - w, self.num_tokens, device=self.keys.device)


@dataclass(frozen=True)
class KeptTokens:
    """Per-KV-head kept token indices.

    indices: [kv_heads, max_kept] int64, each row sorted ascending and unique in its first counts[h]
             entries, padded with -1 after them.
    counts:  [kv_heads] int64, B_h; counts.sum() equals kv_heads * the layer budget exactly.
    """

    indices: torch.Tensor
    counts: torch.Tensor

    def head(self, h: int) -> torch.Tensor:
        """[B_h] sorted kept indices of KV head h."""
        return self.indices[h, : int(self.counts[h])]

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @classmethod
    def from_mask(cls, keep: torch.Tensor) -> KeptTokens:
        """Kept tokens from a boolean mask ``keep`` [kv_heads, n]."""
        kv_heads, n = keep.shape
        counts = keep.sum(dim=1, dtype=torch.int64)
        positions = torch.arange(n, device=keep.device).expand(kv_heads, n)
        # Evicted positions sort after every kept one, so each row starts with its kept indices ascending.
        ordered = torch.where(keep, positions, n).sort(dim=1).values
        width = int(counts.max()) if kv_heads else 0
        indices = ordered[:, :width]
        indices = torch.where(indices == n, -1, indices)
        return cls(indices=indices, counts=counts)

    def to_mask(self, num_tokens: int) -> torch.Tensor:
        """[kv_heads, num_tokens] bool, True at each head's kept tokens (``from_mask``'s inverse)."""
        heads = self.counts.shape[0]
        mask = torch.zeros(heads, num_tokens + 1, dtype=torch.bool, device=self.indices.device)
        index = torch.where(self.indices >= 0, self.indices, num_tokens).reshape(heads, -1)
        return mask.scatter_(1, index, True)[:, :num_tokens]

    @classmethod
    def everything(cls, kv_heads: int, n: int, device: torch.device | str = "cpu") -> KeptTokens:
        """Every token of every head (budget >= n)."""
        indices = torch.arange(n, device=device).expand(kv_heads, n).contiguous()
        return cls(indices=indices, counts=torch.full((kv_heads,), n, dtype=torch.int64, device=device))


class EvictionPolicy(ABC):
    """Chooses kept tokens per KV head for one layer.

    Budgets are per-head averages in tokens: a layer with H KV heads keeps exactly H * layer_budget tokens,
    split across heads as the policy likes (uniform methods keep layer_budget per head).
    """

    #: short user-facing name, e.g. "ada-snapkv"; set by the registry.
    name: str = ""
    #: False on a class whose own code never reads ``LayerKV.values`` (what it wraps may: ``reads_values``).
    reads_own_values: ClassVar[bool] = True
    #: True on a method whose score of an entry reads that entry's own cache row alone (no queries, no
    #: neighbours): between chunks it judges held entries by its own scores, which keep what the whole
    #: prompt would keep (``between_chunks``), rather than by a blend with a key score.
    scores_own_rows: ClassVar[bool] = False

    def layer_budget(self, budget: int, num_tokens: int, layer_idx: int, num_layers: int) -> int:
        """Average kept tokens per head for this layer given the request's average ``budget``.

        Uniform by default; PyramidKV overrides it. Deterministic: the scheduler-side block accounting
        calls it without seeing any tensor.
        """
        return min(budget, num_tokens)

    @property
    def min_budget(self) -> int:
        """Smallest per-head budget ``select`` accepts below n (tokens the method always keeps)."""
        return 0

    @property
    def adapts_kept_count(self) -> bool:
        """True when the scores set how many entries a layer keeps, at most H x its budget (which is then a
        ceiling; KVzap's threshold): ``select`` may keep fewer and the layers differ."""
        return False

    @property
    def pools_layers(self) -> bool:
        """True when one budget is shared by every layer of a request (KVzap's ``budget_scope: "model"``):
        the layers' and heads' counts differ, and the request's blocks are pooled across layers."""
        return False

    @property
    def reads_query_statistics(self) -> bool:
        """True when it (or a policy it composes) scores with running statistics of every prompt query
        (Expected Attention), which a caller evicting chunk by chunk must carry across the chunks."""
        return any(
            part.reads_query_statistics for part in composed_parts(self) if isinstance(part, EvictionPolicy)
        )

    def kept_score_floor(self, layer: LayerKV) -> float | None:
        """The score an entry of ``layer`` must exceed to be kept at all when layers are ranked together
        (``pools_layers``; KVzap's threshold), or None: no floor."""
        return None

    def forced_by_position(self, positions: torch.Tensor, window_end: int) -> torch.Tensor:
        """Bool mask of held entries at ``positions`` (any shape, -1 padding) that a ranking across layers
        keeps whatever their scores, the newest arrived token being ``window_end - 1``: none by default."""
        return torch.zeros_like(positions, dtype=torch.bool)

    def query_window(self, num_tokens: int) -> int:
        """How many trailing prompt queries ``select`` needs in ``LayerKV.queries`` (0: none)."""
        return 0

    def always_kept(self, num_tokens: int, budget: int) -> torch.Tensor:
        """[k] int64 token positions every head keeps whatever the scores (window, sinks)."""
        return torch.empty(0, dtype=torch.int64)

    @abstractmethod
    def select(self, layer: LayerKV, budget: int) -> KeptTokens:
        """Kept tokens of every KV head of ``layer`` for the per-head average ``budget`` of this layer
        (already passed through ``layer_budget``). Must keep exactly ``num_kv_heads * budget`` tokens."""

    def select_after(self, layer: LayerKV, budget: int, fixed: int) -> KeptTokens:
        """Kept tokens among ``[fixed, n)`` when the caller keeps tokens ``[0, fixed)`` anyway (a prefix
        shared with other requests): ``budget`` per head on average, indices in ``[fixed, n)``.

        This default judges the tokens after the prefix as a prompt of their own (the prefix out of view);
        scored methods override it to score the whole layer and choose after the prefix."""
        if fixed <= 0:
            return self.select(layer, budget)
        private = after_prefix(layer, fixed)
        if bool((private.positions() < 0).any()):
            raise ValueError(f"{self._label()}: queries at positions before the shared prefix end ({fixed})")
        return shifted(self.select(private, budget), fixed)

    def kept_context_form(self, block_size: int) -> EvictionPolicy | None:
        """This method as it keeps a context (``kv_context: "keep"``, ``layout/context_reuse.py``): every
        head of every layer keeps a whole number of ``block_size``-token sub-blocks; None when it cannot.
        A uniform top-k method is its own form (its budget B' is a multiple of the block size); Ada-KV
        gives its own (head budgets in whole blocks)."""
        return self if keeps_equal_counts(self) else None

    def keep_all_or_check(self, layer: LayerKV, budget: int) -> KeptTokens | None:
        """Every token when ``budget`` >= n (nothing to evict); otherwise None once ``budget`` is checked.

        Raises ValueError when ``budget`` is not an int, or is below the tokens this method always keeps.
        """
        if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
            raise ValueError(f"{self._label()}: budget={budget!r} must be an int (tokens per KV head)")
        budget = int(budget)
        if budget >= layer.num_tokens:
            return KeptTokens.everything(layer.num_kv_heads, layer.num_tokens, layer.keys.device)
        if budget < max(1, self.min_budget):
            raise ValueError(
                f"{self._label()}: budget={budget} tokens per head is below the {self.min_budget} tokens it "
                f"always keeps (window/sinks); use a budget >= {max(1, self.min_budget)} or a smaller window"
            )
        return None

    def _label(self) -> str:
        return self.name or type(self).__name__


class ScoredPolicy(EvictionPolicy):
    """A policy defined by one score per (KV head, token); uniform top-``budget`` per head.

    Subclasses implement ``score``; tokens the method always keeps score ``+inf``. Ada-KV and CriticalKV
    wrap any ScoredPolicy and reuse its scores with their own selection.
    """

    @abstractmethod
    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        """[kv_heads, n] float32 importance, higher is kept first; ``+inf`` marks always-kept tokens."""

    def select(self, layer: LayerKV, budget: int) -> KeptTokens:
        if (everything := self.keep_all_or_check(layer, budget)) is not None:
            return everything
        return KeptTokens.from_mask(top_k_mask(self.score(layer, budget), budget))

    def select_after(self, layer: LayerKV, budget: int, fixed: int) -> KeptTokens:
        """Scores of the whole layer (the prefix in the softmax), top-``budget`` per head after it."""
        if fixed <= 0:
            return self.select(layer, budget)
        if (everything := self.keep_all_or_check(after_prefix(layer, fixed), budget)) is not None:
            return shifted(everything, fixed)
        scores = self.score(layer, budget)[:, fixed:]
        return shifted(KeptTokens.from_mask(top_k_mask(scores, budget)), fixed)


class WrappingPolicy(EvictionPolicy):
    """A policy around another one, ``inner`` (Ada-KV, CriticalKV): its layer budgets, smallest budget,
    query window and always-kept tokens are the inner policy's; only the selection is its own."""

    inner: EvictionPolicy

    def layer_budget(self, budget: int, num_tokens: int, layer_idx: int, num_layers: int) -> int:
        return self.inner.layer_budget(budget, num_tokens, layer_idx, num_layers)

    @property
    def min_budget(self) -> int:
        return self.inner.min_budget

    def query_window(self, num_tokens: int) -> int:
        return self.inner.query_window(num_tokens)

    def always_kept(self, num_tokens: int, budget: int) -> torch.Tensor:
        return self.inner.always_kept(num_tokens, budget)


class RecentWindowPolicy(EvictionPolicy):
    """A method judged by every prompt query that always keeps the newest ``window`` tokens (H2O, RoCo)."""

    window: int

    @property
    def min_budget(self) -> int:
        return self.window

    def query_window(self, num_tokens: int) -> int:
        return num_tokens

    def always_kept(self, num_tokens: int, budget: int) -> torch.Tensor:
        return torch.arange(max(0, num_tokens - self.window), num_tokens)


def keeps_equal_counts(policy: EvictionPolicy | None) -> bool:
    """True when every head of every layer keeps the same count (uniform top-k per head with the default
    per-layer budget): one sub-block table then serves all of a request's layers."""
    return (
        isinstance(policy, ScoredPolicy)
        and type(policy).layer_budget is EvictionPolicy.layer_budget
        and not policy.adapts_kept_count
        and not policy.pools_layers
    )


def shifted(kept: KeptTokens, offset: int) -> KeptTokens:
    """``kept`` with every index moved ``offset`` tokens later (padding stays -1)."""
    return KeptTokens(torch.where(kept.indices >= 0, kept.indices + offset, -1), kept.counts)


def after_prefix(layer: LayerKV, fixed: int) -> LayerKV:
    """A view of ``layer`` holding only tokens ``[fixed, n)``, its query positions counted from ``fixed``."""
    return dataclasses.replace(
        layer,
        keys=layer.keys[:, fixed:],
        values=layer.values_slice(fixed),
        query_positions=layer.positions() - fixed,
    )


def composed_parts(policy: object) -> list[object]:
    """The policies ``policy`` wraps: its ``inner``, ``first`` and ``second`` fields that are set."""
    parts = (getattr(policy, field, None) for field in ("inner", "first", "second"))
    return [part for part in parts if part is not None]


def reads_values(policy: EvictionPolicy) -> bool:
    """True when ``policy`` or a policy it composes reads ``LayerKV.values``; a caller that must read values
    from the cache (the shared-prefix and per-chunk re-scores) reads only the keys otherwise."""
    return policy.reads_own_values or any(
        reads_values(part) for part in composed_parts(policy) if isinstance(part, EvictionPolicy)
    )


def check_int(owner: str, field: str, value: object, minimum: int) -> None:
    """Raise ValueError naming ``owner.field`` unless ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {field}={value!r} is not valid; it must be an int >= {minimum}")


def check_fraction(owner: str, field: str, value: object, low: float, high: float) -> None:
    """Raise ValueError naming ``owner.field`` unless ``value`` is a number in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{owner}: {field}={value!r} is not valid; it must be a number in [{low}, {high}]")


def check_choice(owner: str, field: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise ValueError naming ``owner.field`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{owner}: {field}={value!r} is not valid; choose one of {', '.join(choices)}")
