"""The question echo as a registry property: "takes an echo" is asked of the registry (settings never build a
policy to find it out), and it names the same methods as building each one and asking for its echo copy."""

from __future__ import annotations

import pytest

from vllm_kvevict.datapath.question_echo import echo_policy
from vllm_kvevict.policies.registry import (
    available_methods,
    build_policy,
    method_takes_echo,
    methods_taking_echo,
)
from vllm_kvevict.settings.config import DEFAULT_ECHO_WIDTH, EvictionConfig
from vllm_kvevict.settings.parsers import EvictionConfigError


def test_the_registry_names_the_methods_whose_policy_takes_the_echo():
    built = [info.name for info in available_methods() if echo_policy(build_policy(info.name), 8) is not None]
    assert methods_taking_echo() == built
    assert [info.name for info in available_methods() if info.takes_echo] == built
    assert {"snapkv", "pyramidkv", "ada-snapkv", "critical-ada-snapkv", "nacl"} <= set(built)
    assert set(built).isdisjoint({"streamingllm", "h2o", "knorm", "keydiff", "expected-attention", "roco"})
    assert not method_takes_echo("ada-expected-attention") and not method_takes_echo("no-such-method")


@pytest.mark.parametrize("info", available_methods(), ids=lambda info: info.name)
def test_the_default_echo_follows_the_registry(info):
    config = EvictionConfig(method=info.name, budget=0.25)
    assert config.question_echo == (DEFAULT_ECHO_WIDTH if info.takes_echo else 0)


def test_an_echo_for_a_method_without_one_names_the_methods_that_take_it():
    with pytest.raises(EvictionConfigError, match="valid methods: " + ", ".join(methods_taking_echo())):
        EvictionConfig(method="h2o", budget=0.25, question_echo=16)
