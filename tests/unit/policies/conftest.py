"""Fixtures for the policy tests: random layers of any shape."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from policy_layers import random_layer

from vllm_kvevict.policies.base import LayerKV


@pytest.fixture
def make_layer() -> Callable[..., LayerKV]:
    return random_layer
