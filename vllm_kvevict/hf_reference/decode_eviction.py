"""Decoding in HF transformers with every KV head capped while generating, by the decode-time policies.

The schedule is the server's: the prompt is prefilled with full attention, then each generated token is
fed one at a time; right after the forward that writes the KV of the g-th generated token with
``g % interval == 0``, every layer of every row re-scores what it holds (``observe`` with the recent
queries, ``select`` down to the cap, ``state.keep``), so a head never holds more than cap + interval
entries. Evicted entries are hidden by the masked runner's attention function (``kvevict_evicted``); the
cache keeps every position, so positions stay the true ones. Several configurations (methods x caps)
run as rows of one batch over the same tokens (teacher-forced) or their own greedy tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from vllm_kvevict.hf_reference.model import attention_modules
from vllm_kvevict.policies.base import KeptTokens
from vllm_kvevict.policies.decode.decode_policy import (
    DecodeEvictionPolicy,
    DecodeState,
    ada_caps_from_scores,
    gather_padded,
)
from vllm_kvevict.policies.decode.held_layer import HeldLayer
from vllm_kvevict.policies.kept_masks import across_layers_mask


@dataclass(frozen=True)
class DecodeCap:
    """One configuration: ``policy`` capping each KV head at ``cap`` entries (None: the full cache), with
    Ada-style ragged caps across the heads of a layer (summing to H x cap) when ``ada_alpha`` is given, or
    with every layer's held entries ranked together when ``pooled`` (the best ``L x H x cap`` of the
    method's scores: the server's ``budget_scope: "model"``, ``datapath/executor.py``'s ``AcrossLayers``)."""

    policy: DecodeEvictionPolicy | None
    cap: int = 0
    ada_alpha: float | None = None
    schedule: Callable[[int], int | None] | None = None
    pooled: bool = False

    def rescore_cap(self, generated: int, interval: int) -> int | None:
        """The per-head cap to re-score to once ``generated`` tokens are in the cache, or None (no re-score).

        Default: ``cap`` whenever ``generated`` is a multiple of ``interval``; ``schedule`` replaces that
        rule (e.g. the server's block-aligned plan, ``RequestPlan.rescores_at``/``kept_length``).
        """
        if self.policy is None:
            return None
        if self.schedule is not None:
            return self.schedule(generated)
        return self.cap if generated % interval == 0 else None

    def __post_init__(self) -> None:
        if self.policy is not None and self.cap < self.policy.min_cap:
            raise ValueError(f"cap={self.cap} is below {self.policy.name}'s minimum {self.policy.min_cap}")
        if self.pooled and (self.policy is None or self.policy.query_window or not self.policy.reads_values):
            name = "the full cache" if self.policy is None else self.policy.name or type(self.policy).__name__
            raise ValueError(
                f"pooled=True with {name}: ranking across layers needs a method that scores each entry from "
                "its own key and value with no queries (kvzap)"
            )

    @property
    def label(self) -> str:
        if self.policy is None:
            return "full"
        ada = "" if self.ada_alpha is None else f" ada({self.ada_alpha})"
        pooled = " pooled" if self.pooled else ""
        return f"{self.policy.name or type(self.policy).__name__}{ada}{pooled}@{self.cap}"

    @property
    def reads_layers(self) -> bool:
        """True when the method judges each layer from its own rows (keys and values with the layer index:
        a learned scorer's, ``reads_values``; every ``pooled`` one is, ``__post_init__``)."""
        return self.policy is not None and self.policy.reads_values


@dataclass
class CappedRun:
    """What a capped decode produced, per row (configuration).

    tokens: [rows, T] the tokens fed after the prompt (teacher-forced) or chosen (greedy);
    nll: [rows, T] float64 negative log-likelihood of tokens[:, t] under the logits that preceded it;
    max_held: [rows] int64 the most entries any head of any layer held at any step;
    held: per row [layers * kv_heads, L] int64 the positions held at the end (layer l's head h is row
    l * kv_heads + h, -1 padded).
    """

    labels: list[str]
    tokens: torch.Tensor
    nll: torch.Tensor
    max_held: torch.Tensor
    held: list[torch.Tensor] = field(default_factory=list, repr=False)
    logits: torch.Tensor | None = field(default=None, repr=False)


class QueryRing:
    """Records, for one attention layer, the last ``size`` post-RoPE queries of every batch row.

    Attached as the module's ``kvevict_recorder``: the attention function calls ``record`` at every
    forward. queries: [rows, q_heads, k, d] float32; positions: [k] int64 (rows advance in lockstep).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.queries: torch.Tensor | None = None
        self.end = 0

    def record(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        new = query.detach().float()[:, :, -self.size :] if self.size else query[:, :, :0].float()
        self.queries = new if self.queries is None else torch.cat([self.queries, new], dim=2)
        self.queries = self.queries[:, :, self.queries.shape[2] - min(self.size, self.queries.shape[2]) :]
        self.end += query.shape[2]

    @property
    def positions(self) -> torch.Tensor:
        k = 0 if self.queries is None else self.queries.shape[2]
        return torch.arange(self.end - k, self.end)


@dataclass
class _Row:
    """What one configuration holds, every layer at once: layer l's KV head h is row l * H + h of
    ``held`` [layers * H, L] (positions, -1 padded) and of the method's state. Every method treats heads
    independently, so one ``observe``/``select`` call covers all layers; only Ada caps are per layer."""

    held: torch.Tensor
    state: DecodeState | None


class CappedDecoder:
    """The bookkeeping of a capped decode over a batch of configurations (one row each)."""

    def __init__(self, model: PreTrainedModel, configs: Sequence[DecodeCap], interval: int) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval={interval!r} must be an int >= 1")
        # Per row, the recent queries its method gets at a re-score, as on the server (its query ring holds
        # min(query_window, queries_needed(interval)) per request): the ones since the last re-score for
        # H2O/RoCo, the window for SnapKV. At a first re-score soon after the prompt they include the
        # prompt's last queries.
        self.needed = [0] * len(configs)
        for index, config in enumerate(configs):
            if config.policy is not None:
                config.policy.check_interval(interval)
                policy = config.policy
                self.needed[index] = min(policy.query_window, policy.queries_needed(interval))
        self.model = model
        self.configs = list(configs)
        self.interval = interval
        self.modules = attention_modules(model)
        self.kv_heads = model.config.num_key_value_heads
        self.rings = [QueryRing(max(self.needed, default=0)) for _ in self.modules]
        self.rows: list[_Row] = []
        self.length = 0
        self.synced = 0  # positions up to here are in every row's held entries
        self.max_held = torch.zeros(len(self.configs), dtype=torch.int64)
        self.evicted = torch.zeros(len(self.configs), len(self.modules), self.kv_heads, 0, dtype=torch.bool)

    @contextmanager
    def attached(self) -> Iterator[None]:
        """Query rings and (empty) eviction masks on every attention layer for the block."""
        for idx, (module, ring) in enumerate(zip(self.modules, self.rings, strict=True)):
            module.kvevict_recorder = ring
            module.kvevict_evicted = self.evicted[:, idx]
        try:
            yield
        finally:
            for module in self.modules:
                del module.kvevict_recorder
                del module.kvevict_evicted

    def start(self, prompt_len: int) -> None:
        """After the prompt's prefill: every row holds the whole prompt in every layer."""
        self.length = self.synced = prompt_len
        device = self.model.device
        heads = len(self.modules) * self.kv_heads
        held = torch.arange(prompt_len, device=device).expand(heads, -1)
        self.rows = [
            _Row(held.clone(), None if c.policy is None else c.policy.init_state(heads, device))
            for c in self.configs
        ]
        self.max_held[:] = prompt_len

    def due(self, generated: int) -> list[int | None]:
        """Per row, the cap it re-scores to once ``generated`` tokens are in the cache (None: it does not)."""
        return [config.rescore_cap(generated, self.interval) for config in self.configs]

    def advance(self, cache: DynamicCache, generated: int, count: int = 1) -> None:
        """``count`` more tokens are in the cache, the last being the ``generated``-th after the prompt;
        re-score the rows due at ``generated`` (no row may be due before it: feed in chunks that end at
        re-scores)."""
        self.length += count
        caps = self.due(generated)
        if any(cap is not None for cap in caps):
            self.rescore(cache, caps)

    def catch_up(self) -> None:
        """Append the positions written since the last call to every row's held entries, and note the most
        any head holds (the peak comes right before a re-score)."""
        if self.synced == self.length:
            return
        heads = len(self.modules) * self.kv_heads
        new = torch.arange(self.synced, self.length, device=self.model.device).expand(heads, -1)
        for index, row in enumerate(self.rows):
            row.held = torch.cat([row.held, new], dim=1)
            peak = int((row.held >= 0).sum(dim=1).max())
            self.max_held[index] = max(int(self.max_held[index]), peak)
        self.synced = self.length

    def rescore(self, cache: DynamicCache, caps: Sequence[int | None]) -> None:
        """Rows with a cap: observe, select down to the cap, compact, hide the rest, all layers at once."""
        self.catch_up()
        layers, heads = len(self.modules), self.kv_heads
        evicted = torch.zeros(len(self.configs), layers, heads, self.length, dtype=torch.bool)
        evicted[..., : self.evicted.shape[3]] = self.evicted
        assert all(ring.queries is not None for ring in self.rings), "the prefill recorded the queries"
        for index, (config, row) in enumerate(zip(self.configs, self.rows, strict=True)):
            if config.policy is None or caps[index] is None:
                continue
            if config.reads_layers:
                kept = self._kept_by_layer(config, row, cache, index, int(caps[index]))  # type: ignore[arg-type]
                row.held = gather_padded(row.held, kept, -1)
                evicted[index] = self._hidden(row).reshape(layers, heads, self.length)
                continue
            keys = torch.cat([cache.layers[i].keys[index] for i in range(layers)])  # [layers*H, length, d]
            held_keys = keys.gather(1, row.held.clamp(min=0)[..., None].expand(-1, -1, keys.shape[2]))
            last = self.needed[index]
            queries = torch.cat([ring.queries[index, :, -last:] for ring in self.rings])  # type: ignore[index]
            positions = self.rings[0].positions[-last:]
            policy = config.policy
            # Every layer's heads as the rows of one layer: the methods here judge each head alone.
            layer = HeldLayer(row.held, held_keys)
            state = policy.observe(row.state, layer, queries, positions)
            cap: int | torch.Tensor = int(caps[index])  # type: ignore[arg-type]
            if config.ada_alpha is not None:
                scores = policy.scores(state, layer).reshape(layers, heads, -1)
                held = row.held.reshape(layers, heads, -1)
                cap = torch.cat(
                    [
                        ada_caps_from_scores(scores[i], held[i], int(cap), config.ada_alpha)
                        for i in range(layers)
                    ]
                )
            kept, _ = policy.select(state, layer, cap)
            if state is not None:
                state.keep(kept)
            row.state = state
            row.held = gather_padded(row.held, kept, -1)
            evicted[index] = self._hidden(row).reshape(layers, heads, self.length)
        self.evicted = evicted.to(self.model.device)
        for idx, module in enumerate(self.modules):
            module.kvevict_evicted = self.evicted[:, idx]

    def _hidden(self, row: _Row) -> torch.Tensor:
        """[layers * H, length] bool: True at the positions ``row`` no longer holds."""
        hidden = torch.ones(row.held.shape[0], self.length + 1, dtype=torch.bool)
        # Column `length` absorbs the padding (-1 -> length) and is cut off.
        hidden.scatter_(1, torch.where(row.held >= 0, row.held, self.length).cpu(), False)
        return hidden[:, : self.length]

    def _kept_by_layer(
        self, config: DecodeCap, row: _Row, cache: DynamicCache, index: int, cap: int
    ) -> torch.Tensor:
        """[layers * H, M] the held columns ``row`` keeps, -1 padded, for a stateless method that scores
        each layer from its own keys and values (``HeldLayer`` with the layer index): per layer its
        ``select`` down to ``cap`` per head, or with ``pooled`` every layer's scores ranked together, the
        best ``layers x H x cap`` (``+inf`` first)."""
        policy = config.policy
        assert policy is not None and row.state is None, "a stateless method that needs no queries"
        layers, heads = len(self.modules), self.kv_heads
        held = row.held.reshape(layers, heads, -1)
        layer_views = []
        for i in range(layers):
            rows = held[i].clamp(min=0)[..., None]
            keys, values = cache.layers[i].keys[index], cache.layers[i].values[index]  # [H, length, d]
            picked = [part.gather(1, rows.expand(-1, -1, part.shape[2])) for part in (keys, values)]
            layer_views.append(HeldLayer(held[i], picked[0], picked[1], i, layers))
        if not config.pooled:
            allocation = "uniform" if config.ada_alpha is None else "ada"
            caps = [policy.layer_caps(None, view, cap, allocation) for view in layer_views]
            kept = [policy.select(None, view, c)[0] for view, c in zip(layer_views, caps, strict=True)]
            width = max(k.shape[1] for k in kept)
            return torch.cat([torch.nn.functional.pad(k, (0, width - k.shape[1]), value=-1) for k in kept])
        scores = torch.stack([policy.scores(None, layer).float() for layer in layer_views])
        valid = held >= 0
        keep = across_layers_mask(scores, min(layers * heads * cap, int(valid.sum()))) & valid
        return KeptTokens.from_mask(keep.reshape(layers * heads, -1)).indices


@torch.inference_mode()
def capped_decode(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    configs: Sequence[DecodeCap],
    steps: int,
    interval: int,
    forced: torch.Tensor | None = None,
    keep_logits: bool = False,
    progress: Callable[[int], None] | None = None,
) -> CappedRun:
    """Decode ``steps`` tokens after ``prompt_ids`` ([P]) for every configuration at once.

    forced: [steps] the tokens to feed (teacher forcing; ``nll`` scores them) or None (greedy: each row
    feeds its own argmax). Teacher-forced tokens between two re-scores go through one forward: nothing is
    evicted between re-scores, so each token sees exactly what it sees when fed alone. Returns a
    ``CappedRun``; ``logits`` [rows, steps, vocab] float32 only when ``keep_logits``. ``progress(t)`` is
    called with the tokens done so far.
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if forced is not None and forced.shape != (steps,):
        raise ValueError(f"forced must be [steps={steps}]; got {tuple(forced.shape)}")
    rows = len(configs)
    decoder = CappedDecoder(model, configs, interval)
    prompt_len = int(prompt_ids.shape[-1])
    cache = DynamicCache(config=model.config)
    tokens = torch.zeros(rows, steps, dtype=torch.int64)
    nll = torch.zeros(rows, steps, dtype=torch.float64)
    all_logits: list[torch.Tensor] = []
    with decoder.attached():
        ids = prompt_ids.reshape(1, -1).to(model.device).expand(rows, -1)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:]
        decoder.start(prompt_len)
        done = 0  # tokens chosen; tokens[:, :done] are known, the cache holds done - 1 of them
        while True:
            width = logits.shape[1]
            logits = logits.float()
            chosen = logits[:, -1].argmax(dim=-1)[:, None] if forced is None else forced[done : done + width]
            chosen = chosen.to(logits.device).expand(rows, width)
            tokens[:, done : done + width] = chosen.cpu()
            log_probs = torch.log_softmax(logits.double(), dim=-1)
            nll[:, done : done + width] = -log_probs.gather(2, chosen[..., None])[..., 0].cpu()
            if keep_logits:
                all_logits.append(logits.cpu())
            done += width
            if progress is not None:
                progress(done)
            if done == steps:
                break
            # Feed tokens done-1 .. up to the next re-score (one at a time when greedy).
            end = done + 1 if forced is None else _next_rescore(decoder, done, steps)
            source = tokens[:, done - 1 : end - 1] if forced is None else forced[None, done - 1 : end - 1]
            feed = source.to(model.device).expand(rows, -1)
            position = torch.arange(prompt_len + done - 1, prompt_len + end - 1, device=model.device)
            out = model(
                input_ids=feed,
                past_key_values=cache,
                use_cache=True,
                position_ids=position.expand(rows, -1),
            )
            logits = out.logits
            decoder.advance(cache, end - 1, count=end - done)
        decoder.catch_up()
    return CappedRun(
        labels=[c.label for c in configs],
        tokens=tokens,
        nll=nll,
        max_held=decoder.max_held.clone(),
        held=[row.held.cpu() for row in decoder.rows],
        logits=torch.cat(all_logits, dim=1) if keep_logits else None,
    )


def _next_rescore(decoder: CappedDecoder, done: int, steps: int) -> int:
    """The chunk end when ``done`` tokens are chosen: feeding tokens done-1 .. end-2 brings the cache to
    end - 1 generated tokens, the first count >= done at which some row re-scores (or the last token)."""
    generated = done
    while generated < steps - 1 and not any(cap is not None for cap in decoder.due(generated)):
        generated += 1
    return generated + 1
