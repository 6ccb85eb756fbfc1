"""Registry, parameters, budgets and the ``vllm-kvevict methods`` listing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_kvevict.cli.main import main
from vllm_kvevict.policies import (
    H2O,
    AdaKV,
    CriticalKV,
    KeyDiff,
    KNorm,
    NaCl,
    PyramidKV,
    RoCo,
    SnapKV,
    StreamingLLM,
    available_methods,
    build_policy,
    method_names,
)

REGISTERED_METHODS = [
    "snapkv",
    "pyramidkv",
    "ada-snapkv",
    "ada-pyramidkv",
    "critical-snapkv",
    "critical-ada-snapkv",
    "streamingllm",
    "h2o",
    "nacl",
    "keydiff",
    "knorm",
    "expected-attention",
    "ada-expected-attention",
    "roco",
    "kvzap",
    "ada-kvzap",
]


def test_registry_holds_the_sixteen_methods() -> None:
    assert method_names() == REGISTERED_METHODS
    assert [m.name for m in available_methods()] == REGISTERED_METHODS


def test_names_map_to_composed_policies_with_paper_defaults() -> None:
    ada = build_policy("ada-snapkv")
    assert isinstance(ada, AdaKV) and ada.inner == SnapKV(window=32, kernel=7, pooling="max")
    assert ada.alpha == 0.2 and ada.name == "ada-snapkv"
    critical = build_policy("critical-ada-snapkv")
    assert isinstance(critical, CriticalKV) and isinstance(critical.inner, AdaKV)
    assert (critical.first_stage_ratio, critical.epsilon) == (0.5, 1e-4)
    assert isinstance(build_policy("ada-pyramidkv").inner, PyramidKV)
    assert build_policy("streamingllm") == StreamingLLM(sinks=4)
    assert isinstance(build_policy("h2o"), H2O)
    assert isinstance(build_policy("nacl"), NaCl)
    assert isinstance(build_policy("roco"), RoCo)
    assert build_policy("keydiff") == KeyDiff(window=32, sinks=4, span_after=8)
    assert build_policy("knorm") == KNorm(window=32, sinks=4, span_after=8)


def test_parameters_reach_every_part_of_a_composed_policy() -> None:
    policy = build_policy("critical-ada-snapkv", window=64, pooling="avg", kernel=5, alpha=0.3, epsilon=0.01)
    assert policy.inner.inner == SnapKV(window=64, kernel=5, pooling="avg")
    assert policy.inner.alpha == 0.3 and policy.epsilon == 0.01


def test_method_info_lists_parameters_with_defaults() -> None:
    infos = {m.name: m for m in available_methods()}
    assert infos["ada-pyramidkv"].params == {
        "window": 32,
        "kernel": 7,
        "pooling": "max",
        "span_after": 8,
        "beta": 20,
        "alpha": 0.2,
        "allocation": "safeguard",
    }
    assert infos["nacl"].params == {"window": 32, "random_ratio": 0.5, "seed": 0}
    assert all(m.description for m in infos.values())


def test_unknown_method_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'snapkv2'.*valid methods: snapkv, pyramidkv"):
        build_policy("snapkv2")


def test_unknown_parameter_names_it_and_the_valid_ones() -> None:
    with pytest.raises(
        ValueError, match=r"sinks.*'snapkv'.*valid parameters: kernel, pooling, span_after, window"
    ):
        build_policy("snapkv", sinks=4)


@pytest.mark.parametrize(
    "name,params,field",
    [
        ("snapkv", {"window": 0}, "window=0"),
        ("snapkv", {"kernel": 4}, "kernel=4"),
        ("snapkv", {"pooling": "mean"}, "pooling='mean'"),
        ("snapkv", {"window": "32"}, "window='32'"),
        ("pyramidkv", {"beta": 0}, "beta=0"),
        ("ada-snapkv", {"alpha": 1.5}, "alpha=1.5"),
        ("critical-snapkv", {"first_stage_ratio": -0.1}, "first_stage_ratio=-0.1"),
        ("streamingllm", {"sinks": -1}, "sinks=-1"),
        ("nacl", {"random_ratio": 2}, "random_ratio=2"),
        ("nacl", {"seed": -3}, "seed=-3"),
        ("roco", {"std_ratio": True}, "std_ratio=True"),
    ],
)
def test_bad_parameter_values_name_the_field_and_what_is_valid(name: str, params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field.replace('.', '[.]')}.*(must|choose)"):
        build_policy(name, **params)


def test_methods_subcommand_prints_one_line_per_method(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == REGISTERED_METHODS
    ada = next(line for line in lines if line.startswith("ada-snapkv "))
    assert "window=32" in ada and "kernel=7" in ada and "pooling='max'" in ada and "alpha=0.2" in ada
    assert "sinks=4" in next(line for line in lines if line.startswith("streamingllm"))


def test_methods_console_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vllm_kvevict.cli.main", "methods"], capture_output=True, text=True, check=True
    ).stdout
    assert len(out.splitlines()) == len(REGISTERED_METHODS) and out.startswith("snapkv")
