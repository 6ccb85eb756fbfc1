"""The newest prompt queries of requests prefilled in chunks, per request and layer: a chunk shorter than
the observation window takes the rest of its window from the previous chunks' queries, and the echo pass
judges the prompt's own last window beside the echo's queries."""

from __future__ import annotations

import torch

#: queries kept per request and layer between chunks, for the next chunk's observation window.
MAX_SAVED_QUERIES = 64


class PromptQueries:
    """At most ``MAX_SAVED_QUERIES`` newest prompt queries [<= MAX, Hq, D] of each request and layer."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.saved: dict[str, list[torch.Tensor | None]] = {}  # req -> per layer

    def drop(self, req_id: str) -> None:
        self.saved.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.saved

    def observation(self, layer_idx: int, req_id: str, current: torch.Tensor, window: int) -> torch.Tensor:
        """[Hq, w, D] the last ``window`` queries ending with ``current`` [n, Hq, D] (this step's rows of the
        request up to the window's end), earlier chunks' where ``current`` is shorter than the window."""
        saved = self.saved.get(req_id, [None] * self.num_layers)[layer_idx]
        if current.shape[0] < window and saved is not None:
            current = torch.cat([saved.to(current.dtype), current])
        return current[max(0, current.shape[0] - window) :].transpose(0, 1)

    def save(self, layer_idx: int, req_id: str, current: torch.Tensor) -> None:
        """Keep the newest ``MAX_SAVED_QUERIES`` of the request's prompt queries so far, ``current``
        [n, Hq, D] (this step's) the newest."""
        per_layer = self.saved.setdefault(req_id, [None] * self.num_layers)
        saved = per_layer[layer_idx]
        if saved is not None and current.shape[0] < MAX_SAVED_QUERIES:
            current = torch.cat([saved, current])
        per_layer[layer_idx] = current[max(0, current.shape[0] - MAX_SAVED_QUERIES) :].clone()

    def window(self, layer_idx: int, req_id: str, window: int) -> torch.Tensor:
        """[w <= window, Hq, D] the newest saved prompt queries of ``layer_idx`` (the prompt's own last window
        once its last chunk ran)."""
        saved = self.saved.get(req_id, [None] * self.num_layers)[layer_idx]
        if saved is None:
            raise RuntimeError(f"request {req_id} layer {layer_idx}: no prompt queries saved for a window")
        return saved[max(0, saved.shape[0] - window) :]
