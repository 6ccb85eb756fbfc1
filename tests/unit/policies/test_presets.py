"""Every packaged preset names a registered method with valid parameters, and is found by its name."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvevict.policies import AdaKV, SnapKV
from vllm_kvevict.policies.presets import is_preset_name, load_preset, packaged_presets, preset_file

PRESETS = packaged_presets()
CHECKOUT_CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_the_package_ships_the_presets() -> None:
    shipped = {"ada-snapkv", "critical-ada-snapkv", "kvpress-ada-snapkv", "kvpress-snapkv", "nacl"}
    assert shipped <= set(PRESETS)


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_builds_its_policy(name: str) -> None:
    preset = load_preset(PRESETS[name])
    assert preset.description
    assert preset.build().name == preset.method


def test_a_name_resolves_to_the_packaged_file() -> None:
    file = preset_file("ada-snapkv")
    assert file == PRESETS["ada-snapkv"]
    assert load_preset(file).method == "ada-snapkv"


def test_the_checkout_configs_folder_is_the_packaged_presets() -> None:
    assert sorted(p.stem for p in CHECKOUT_CONFIGS.glob("*.yaml")) == list(PRESETS)
    assert load_preset(CHECKOUT_CONFIGS / "nacl.yaml") == load_preset(PRESETS["nacl"])


def test_an_unknown_name_is_one_line_listing_the_valid_names() -> None:
    with pytest.raises(LookupError) as raised:
        preset_file("ada-snapk")
    message = str(raised.value)
    assert "no preset named 'ada-snapk'" in message and ", ".join(PRESETS) in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("text", "is_name"),
    [("ada-snapkv", True), ("configs/ada-snapkv.yaml", False), ("mine.yaml", False), ("./nacl", False)],
)
def test_a_bare_word_is_a_name_and_anything_with_a_path_or_suffix_a_file(text: str, is_name: bool) -> None:
    assert is_preset_name(text) is is_name
    if not is_name:
        assert preset_file(text) == Path(text)


def test_kvpress_preset_matches_kvpress_defaults() -> None:
    policy = load_preset(PRESETS["kvpress-ada-snapkv"]).build()
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
