"""Every preset in configs/ names a registered method with valid parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvevict.policies import AdaKV, SnapKV
from vllm_kvevict.policies.presets import load_preset

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))


def test_there_are_presets() -> None:
    assert len(CONFIGS) >= 5


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_each_preset_builds_its_policy(path: Path) -> None:
    preset = load_preset(path)
    assert preset.description
    assert preset.build().name == preset.method


def test_kvpress_preset_matches_kvpress_defaults() -> None:
    policy = load_preset(CONFIGS[0].parent / "kvpress-ada-snapkv.yaml").build()
    assert isinstance(policy, AdaKV) and policy.inner == SnapKV(
        window=64, kernel=5, pooling="avg", span_after=0
    )


def test_bad_presets_name_the_file_and_entry(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: snapkv\nparams: {window: 0}\n")
    with pytest.raises(ValueError, match=r"bad.yaml: SnapKV: window=0"):
        load_preset(bad)
    bad.write_text("method: snapkv\nbudget: 3\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) budget"):
        load_preset(bad)
    bad.write_text("method: snapkvv\n")
    with pytest.raises(ValueError, match=r"unknown eviction method 'snapkvv'"):
        load_preset(bad)
