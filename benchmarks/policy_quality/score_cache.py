"""Reuse attention scores across budgets while the benchmark sweeps them.

A policy recomputes its attention statistics on every ``select`` call, although they depend only on the
layer's tensors, not on the budget. For H2O and RoCo that is a full n x n attention pass per layer, the
most expensive part of the sweep on a 2-core machine. Inside ``reused_scores()`` the scoring functions
that the policy modules call are replaced by memoised versions keyed on the exact tensors (storage,
offset, shape, positions); the results are the same objects the functions would return.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from vllm_kvevict.policies import h2o, nacl, roco, snapkv

_PATCHED: tuple[tuple[object, str], ...] = (
    (snapkv, "window_attention"),
    (nacl, "window_attention"),
    (h2o, "accumulated_attention"),
    (roco, "attention_statistics"),
)


def _tensor_key(tensor: torch.Tensor | None) -> tuple:
    if tensor is None:
        return ()
    if tensor.dim() == 1 and tensor.dtype == torch.int64:
        return (tuple(tensor.tolist()),)
    return (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))


def _memoised(function: Callable, store: dict) -> Callable:
    @functools.wraps(function)
    def wrapper(queries: torch.Tensor, keys: torch.Tensor, query_positions=None, **kwargs):
        key = (function.__name__, _tensor_key(queries), _tensor_key(keys), _tensor_key(query_positions))
        if key not in store:
            store[key] = function(queries, keys, query_positions, **kwargs)
        return store[key]

    return wrapper


@contextmanager
def reused_scores() -> Iterator[None]:
    """Memoise the policies' attention scoring for the duration of the block (one captured prompt)."""
    store: dict = {}
    originals = [(module, name, getattr(module, name)) for module, name in _PATCHED]
    for module, name, function in originals:
        setattr(module, name, _memoised(function, store))
    try:
        yield
    finally:
        for module, name, function in originals:
            setattr(module, name, function)
