"""The unit tests' policies without a scorer directory get a random-weight scorer shaped like their layers
(``learned_scorers.scorer_shaped_like``): every registered method runs on the tiny layers the tests build."""

from __future__ import annotations

import pytest
from learned_scorers import scorer_shaped_like

from vllm_kvevict.policies import served_scorer


@pytest.fixture(autouse=True)
def random_scorer_for_every_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(served_scorer, "scorer_without_directory", scorer_shaped_like)
