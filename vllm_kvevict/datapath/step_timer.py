"""Host time of one step's eviction work by phase (reported as ``metrics.STEP_PHASES``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class StepTimer:
    """Host time of one step's eviction work by phase (``metrics.STEP_PHASES``): ``selection`` is the
    policies' scoring and selection, ``total`` every datapath call after attention (selection, held
    entries, sub-block assignment and the moves' slots)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
