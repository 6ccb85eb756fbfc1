"""Every layer's cache as one tensor, for a request whose blocks are pooled across layers
(``budget_scope: "model"``; ``docs/design_modes.md``, "Per-layer block budgets").

vLLM 0.32 allocates the layer caches of one KV-cache group as views of a single storage, layer outermost
(``allocate_kv_cache``: one backing tensor, a layer stride of ``num_blocks`` blocks). Where that holds, the
whole allocation is one cache ``[L·NB, H, bs, 2D]``: block ``l·NB + b`` is block b of layer l, sub-block
``(l·NB + b)·H + h`` its head h, and vLLM's CPU writer and attention read and write any layer's sub-blocks
through it exactly as through the layer's own view (``tests/unit/adapter/test_pooled_layers_view.py``).
Where it does not hold, pooling is refused with the layout found.
"""

from __future__ import annotations

import torch


class PooledLayoutError(RuntimeError):
    """The layer caches are not one storage with layer ``l`` at ``l`` times the layer's size."""


def pooled_cache(kv_cache: torch.Tensor, layer_idx: int, num_layers: int) -> torch.Tensor:
    """[L·NB, H, bs, 2D] the whole allocation seen from layer ``layer_idx``'s cache [NB, H, bs, 2D] (no copy).

    Raises ``PooledLayoutError`` unless the cache is contiguous, starts ``layer_idx`` layer sizes into its
    storage and the storage holds ``num_layers`` such layers."""
    if not kv_cache.is_contiguous():
        raise PooledLayoutError(
            f"layer {layer_idx}'s KV cache {tuple(kv_cache.shape)} is not contiguous (strides "
            f"{kv_cache.stride()}); its blocks cannot be pooled across layers"
        )
    layer_size = kv_cache.numel()
    start = kv_cache.storage_offset() - layer_idx * layer_size
    stored = kv_cache.untyped_storage().nbytes() // kv_cache.element_size()
    if start != 0 or stored < num_layers * layer_size:
        raise PooledLayoutError(
            f"layer {layer_idx}'s KV cache starts at element {kv_cache.storage_offset()} of a storage of "
            f"{stored} elements; pooling needs layer l at l x {layer_size} in one storage of {num_layers} "
            "layers (vLLM's single-group allocation); serve without budget_scope 'model'"
        )
    shape = (num_layers * kv_cache.shape[0], *kv_cache.shape[1:])
    return kv_cache.as_strided(shape, kv_cache.stride(), 0)
