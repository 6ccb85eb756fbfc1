"""The reference runner's attention function for HF transformers: records what a layer sees, and hides
evicted (KV head, token) entries from later queries.

Registered once under the name ``"kvevict"`` in transformers' ``AttentionInterface`` (with the sdpa mask
builder), it delegates to transformers' own sdpa attention. Per-layer state lives on the attention module
as two optional attributes, set by ``capture``/``generation`` and removed when they are done:

- ``kvevict_recorder``: a ``LayerRecorder`` that keeps the post-RoPE queries, keys and values of the call;
- ``kvevict_evicted``: [batch, kv_heads, m] bool, True where cache entry (head, token < m) of a batch row is
  evicted. Queries of this call never attend to those entries; entries at m and later (tokens added after
  eviction) stay visible, under the usual causal rule. Batch rows are independent sequences that share
  the prompt and differ in what they evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "kvevict"


@dataclass
class LayerRecorder:
    """Post-RoPE tensors of one layer's prefill call, batch 1, kept in float32.

    queries: [q_heads, w, d] the last ``query_window`` queries (all of them when None);
    keys, values: [kv_heads, n, d].
    """

    query_window: int | None = None
    queries: torch.Tensor | None = field(default=None, repr=False)
    keys: torch.Tensor | None = field(default=None, repr=False)
    values: torch.Tensor | None = field(default=None, repr=False)

    def record(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """query [1, q_heads, T, d], key/value [1, kv_heads, n, d] as the attention function receives them."""
        window = query.shape[2] if self.query_window is None else min(self.query_window, query.shape[2])
        self.queries = query[0, :, query.shape[2] - window :].detach().float().clone()
        self.keys = key[0].detach().float().clone()
        self.values = value[0].detach().float().clone()


def visibility_mask(evicted: torch.Tensor, q_len: int, kv_len: int, group: int) -> torch.Tensor:
    """[batch, kv_heads * group, q_len, kv_len] bool, True where a query may attend.

    evicted: [batch, kv_heads, m]. The last q_len of the kv_len cache entries are this call's own tokens
    (causal among themselves); an entry (head h, token j < m) is hidden from every query head of h's
    group when ``evicted[b, h, j]``.
    """
    batch, kv_heads, evicted_len = evicted.shape
    if evicted_len > kv_len:
        raise ValueError(f"eviction mask covers {evicted_len} tokens but the cache holds only {kv_len}")
    query_pos = torch.arange(kv_len - q_len, kv_len, device=evicted.device)
    causal = torch.arange(kv_len, device=evicted.device)[None, :] <= query_pos[:, None]
    hidden = torch.zeros(batch, kv_heads, kv_len, dtype=torch.bool, device=evicted.device)
    hidden[:, :, :evicted_len] = evicted
    return causal[None, None] & ~hidden.repeat_interleave(group, dim=1)[:, :, None, :]


def kvevict_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: sdpa, plus recording and per-head eviction."""
    recorder: LayerRecorder | None = getattr(module, "kvevict_recorder", None)
    if recorder is not None:
        recorder.record(query, key, value)
    evicted: torch.Tensor | None = getattr(module, "kvevict_evicted", None)
    if evicted is not None and bool(evicted.any()):
        if evicted.shape[0] != query.shape[0]:
            raise ValueError(f"eviction masks for {evicted.shape[0]} rows, batch has {query.shape[0]}")
        group = query.shape[1] // key.shape[1]
        attention_mask = visibility_mask(evicted.to(query.device), query.shape[2], key.shape[2], group)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> str:
    """Register ``kvevict_attention`` (idempotent); returns the name to pass as ``attn_implementation``."""
    AttentionInterface.register(ATTENTION_NAME, kvevict_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
