"""KVzap: keep the KV entries a learned scorer predicts KVzip would keep, with no queries (arXiv 2601.07891).

KVzip scores each entry by the attention it gets while the model repeats its context: question-agnostic and
near-lossless, but a second prefill. KVzap fits a small per-layer model that predicts those scores, so
serving pays one matmul per entry. Ours (``surrogate_scorer.py``) reads each entry's own cache row (the
rotation-invariant part of its key, its value), so an entry's score does not depend on which chunk it came
in, on its neighbours or on anything after it: per-chunk eviction keeps what whole-prompt eviction keeps
when the intermediate budget is at least the final one, and a held entry can be scored again from the cache
(between chunks here; at decode time through ``policies/decode/decode_scored.py``).

That holds for a scorer whose heads score alone (``scores_each_head_alone``: head h's output reads only head
h's features). A scorer that reads every head's row of a token to score each head is right only where all
heads hold the same tokens (a whole prompt, before any eviction); after per-head eviction one cache row
holds different tokens in different heads, so such a scorer is refused wherever held entries are scored
again (per-chunk eviction, decode-time caps: ``vllm_adapter/learned_scorer.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_kvevict.policies import served_scorer
from vllm_kvevict.policies.base import (
    EvictionPolicy,
    KeptTokens,
    LayerKV,
    ScoredPolicy,
    check_int,
    composed_parts,
    shifted,
)
from vllm_kvevict.policies.key_scored import sinks_and_recent
from vllm_kvevict.policies.surrogate_scorer import SurrogateScorer

#: how a threshold is compared (``KVzap.threshold_scope``)
THRESHOLD_SCOPES = ("global", "layer")
#: what one budget is shared by (``KVzap.budget_scope``)
BUDGET_SCOPES = ("layer", "model")


@dataclass
class KVzap(ScoredPolicy):
    """Score = the learned scorer's predicted log KVzip score of each entry; the first ``sinks`` and the last
    ``window`` tokens are always kept (kvpress's KVzap runs inside DMSPress, which protects a recent window).

    scorer: a scorer directory (``vllm-kvevict calibrate MODEL --out DIR``); None: the scorer this process
        serves (``served_scorer``: the server's, or the packaged one fitted on the served model).
    threshold: None keeps the budget (top-``budget`` per head); a number keeps every entry whose score is
        above it (kvpress's ``DMSPress``/``ThresholdPress``), so the kept count adapts per head, layer and
        prompt, with the budget as a ceiling: a layer keeps at most H x budget entries (its best-scoring
        ones above the threshold); with ``budget_scope: "model"`` a request keeps at most L x H x budget
        above it, ranked across layers. The server sizes a request's blocks by the ceiling and frees what its
        largest layer (pooled: its mean layer) does not need once the worker reports it
        (``layout/accounting.py``).
    threshold_scope: ``"global"`` compares the predicted scores themselves with the threshold (kvpress's
        rule); ``"layer"`` compares each layer's scores standardised by that layer's level on calibration
        text (``ScorerSpec.score_levels``: (score - mean) / std), so one threshold keeps a similar share in
        every layer on average while the count still adapts per head and prompt.
    budget_scope: ``"layer"`` keeps ``budget`` entries per head in every layer; ``"model"`` ranks the entries
        of every layer and head of a request together and keeps the best ``L x H x budget`` of them
        (KVzip's ranking), a request's blocks pooled across layers so that it holds about the mean layer's
        share, not the largest one's (``docs/design_modes.md``, "Per-layer block budgets"). The CPU backend;
        fixed budgets whole, per chunk and as kept contexts; a threshold whole and per chunk.
    head_unit: > 1 (set by ``kept_context_form``, never by a user) with ``budget_scope: "model"``: every
        (layer, head) count of the ranking is moved to a multiple of it with the same total
        (``kept_masks.whole_unit_mask``), so a kept context fills whole sub-blocks.
    There is no ``span_after``: a token that took its neighbours' scores would score differently after a
    neighbour was evicted between chunks, and per-chunk eviction would no longer keep what whole-prompt
    eviction keeps.
    """

    reads_own_values: ClassVar[bool] = True
    scores_own_rows: ClassVar[bool] = True

    scorer: str | None = None
    window: int = 32
    sinks: int = 4
    threshold: float | None = None
    threshold_scope: str = "global"
    budget_scope: str = "layer"
    head_unit: int = 1

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_int(owner, "window", self.window, 0)
        check_int(owner, "sinks", self.sinks, 0)
        check_int(owner, "head_unit", self.head_unit, 1)
        if self.scorer is not None:
            if not isinstance(self.scorer, str):
                raise ValueError(f"{owner}: scorer={self.scorer!r} is not valid; give a scorer directory")
            served_scorer.load_scorer(self.scorer)  # a directory that is no scorer is refused here
        threshold = self.threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)):
            raise ValueError(
                f"{owner}: threshold={threshold!r} is not valid; give a number (keep entries scoring above "
                "it) or leave it unset (keep the budget)"
            )
        if self.threshold_scope not in THRESHOLD_SCOPES:
            raise ValueError(
                f"{owner}: threshold_scope={self.threshold_scope!r} is not valid; valid: "
                f"{', '.join(THRESHOLD_SCOPES)}"
            )
        if self.threshold_scope != "global" and threshold is None:
            raise ValueError(f"{owner}: threshold_scope={self.threshold_scope!r} needs a threshold")
        if self.budget_scope not in BUDGET_SCOPES:
            raise ValueError(
                f"{owner}: budget_scope={self.budget_scope!r} is not valid; valid: {', '.join(BUDGET_SCOPES)}"
            )

    @property
    def min_budget(self) -> int:
        return self.window + self.sinks

    def always_kept(self, num_tokens: int, budget: int) -> torch.Tensor:
        return sinks_and_recent(num_tokens, self.sinks, self.window)

    def learned_scorer(self, layer: LayerKV) -> SurrogateScorer:
        """The scorer of ``layer`` (on its device); ValueError when it was fitted on other shapes."""
        device = str(layer.keys.device)
        if self.scorer is None:
            scorer = served_scorer.scorer_without_directory(layer)
        else:
            scorer = served_scorer.load_scorer(self.scorer, device)
        scorer = served_scorer.for_layer_heads(scorer, layer.num_kv_heads)  # a tensor-parallel rank's
        spec = scorer.spec
        if (spec.num_layers, spec.num_kv_heads, spec.head_dim) != (
            layer.num_layers,
            layer.num_kv_heads,
            layer.keys.shape[2],
        ):
            raise ValueError(
                f"{self._label()}: the scorer of {spec.model_name} has {spec.num_layers} layers, "
                f"{spec.num_kv_heads} KV heads of {spec.head_dim}; this layer is one of {layer.num_layers}, "
                f"{layer.num_kv_heads} KV heads of {layer.keys.shape[2]}; {served_scorer.CALIBRATE_HINT}"
            )
        return scorer

    def entry_scores(self, layer: LayerKV) -> torch.Tensor:
        """[H, n] float32 predicted log-scores of the layer's entries, on the layer's device."""
        values = layer.value_rows(self._label())
        scores = self.learned_scorer(layer).layer_scores(layer.layer_idx, layer.keys, values)
        return scores.to(layer.keys.device)

    def score(self, layer: LayerKV, budget: int) -> torch.Tensor:
        scores = self.entry_scores(layer)
        forced = self.always_kept(layer.num_tokens, budget).to(scores.device)
        scores[:, forced] = float("inf")
        return scores

    @property
    def adapts_kept_count(self) -> bool:
        return self.threshold is not None

    @property
    def pools_layers(self) -> bool:
        return self.budget_scope == "model"

    def kept_score_floor(self, layer: LayerKV) -> float | None:
        return None if self.threshold is None else self.layer_threshold(layer)

    def forced_by_position(self, positions: torch.Tensor, window_end: int) -> torch.Tensor:
        """The prompt's first ``sinks`` tokens and the newest ``window`` arrived ones (and any after them)."""
        return (positions < self.sinks) | (positions >= window_end - self.window)

    def kept_context_form(self, block_size: int) -> EvictionPolicy | None:
        """Itself per layer (the same count in every head and layer); ranked across layers, the counts of
        every (layer, head) in whole ``block_size`` sub-blocks (``head_unit``); None with a threshold (a
        kept context's entry holds the blocks its budget sets, not a count the scores set)."""
        if not self.pools_layers or self.threshold is not None:
            return super().kept_context_form(block_size)
        form = dataclasses.replace(self, head_unit=block_size)
        form.name = self.name
        return form

    def select(self, layer: LayerKV, budget: int) -> KeptTokens:
        if self.threshold is None:
            return super().select(layer, budget)
        return KeptTokens.from_mask(self._above_threshold(layer, self.score(layer, budget), budget))

    def select_after(self, layer: LayerKV, budget: int, fixed: int) -> KeptTokens:
        if self.threshold is None or fixed <= 0:
            return super().select_after(layer, budget, fixed)
        scores = self.score(layer, budget)[:, fixed:]
        return shifted(KeptTokens.from_mask(self._above_threshold(layer, scores, budget)), fixed)

    def layer_threshold(self, layer: LayerKV) -> float:
        """The predicted score an entry of ``layer`` must exceed to be kept (``threshold_scope``)."""
        assert self.threshold is not None
        if self.threshold_scope == "layer":  # (score - mean) / std > t  <=>  score > mean + t * std
            mean, std = self.learned_scorer(layer).spec.layer_level(layer.layer_idx)
            return mean + self.threshold * std
        return float(self.threshold)

    def _above_threshold(self, layer: LayerKV, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """[H, n] bool: entries scoring above the threshold (``threshold_scope``), at most H x ``budget`` of
        them (the layer's best; forced entries score inf and come first)."""
        above = scores > self.layer_threshold(layer)
        ceiling = scores.shape[0] * budget
        if ceiling >= scores.numel():
            return above
        flat = torch.where(above, scores, float("-inf")).reshape(-1)
        best = torch.zeros_like(above).reshape(-1)
        best[flat.topk(ceiling).indices] = True
        return above & best.reshape(above.shape)

    def with_fixed_budget(self, method: str) -> KVzap:
        """Itself, for a method that allocates a budget (Ada-KV); ValueError when a threshold is set."""
        if self.threshold is not None:
            raise ValueError(
                f"{method}: threshold={self.threshold} keeps a count set by the scores, which {method} "
                "allocates from a budget; use kvzap for the threshold mode"
            )
        if self.budget_scope != "layer":
            raise ValueError(
                f"{method}: budget_scope={self.budget_scope!r} ranks every layer's heads together, which "
                f"{method} allocates per layer; use kvzap for the pooled ranking"
            )
        return self


def learned_part(policy: object) -> KVzap | None:
    """The KVzap inside ``policy`` (itself, or what an Ada-KV/CriticalKV wrapper holds), or None."""
    if isinstance(policy, KVzap):
        return policy
    return next((found for part in composed_parts(policy) if (found := learned_part(part))), None)
