"""A server with a learned method (prefill or decode-time) is refused when vLLM builds its engine config
(before any weight loads), in one line naming ``vllm-kvevict calibrate``, unless the bundled model has a
scorer that fits it; the threshold mode where it cannot be served (per chunk, with a decode-time cap), and a
chunked prefill or a decode-time cap with a scorer that reads every head, are refused there too. Each engine
config is built by real vLLM in a fresh interpreter (``test_plugin.run_scenario``)."""

from __future__ import annotations

import pytest
from learned_scorers import random_scorer, write_scorer_for
from test_plugin import EVICTING_CPU_ATTN, VLLM_CPU_ATTN, run_scenario
from transformers import AutoConfig


@pytest.fixture(scope="module")
def startups(model_dir, tmp_path_factory) -> dict:
    """Engine configs of the bundled model with kvzap: each scenario's error line (or none) and backend."""
    root = tmp_path_factory.mktemp("scorers")
    config = AutoConfig.from_pretrained(model_dir)
    fitting = write_scorer_for(config, root / "fitting")
    mixed = write_scorer_for(config, root / "mixed", per_head=False)
    other = root / "other"
    random_scorer(2, 2, 8).save(other)
    scenarios = {
        "none_ships": {"method": "ada-kvzap", "budget": 64},
        "other_model": {"method": "kvzap", "budget": 64, "params": {"scorer": str(other)}},
        "threshold": {"method": "kvzap", "budget": 64, "params": {"scorer": str(fitting), "threshold": 0.0}},
        "threshold_layer": {
            "method": "kvzap",
            "budget": 64,
            "params": {"scorer": str(fitting), "threshold": 0.5, "threshold_scope": "layer"},
        },
        "threshold_chunked": {
            "method": "kvzap",
            "budget": 64,
            "prefill": "chunked",
            "params": {"scorer": str(fitting), "threshold": 0.0},
        },
        "threshold_pooled_chunked": {
            "method": "kvzap",
            "budget": 64,
            "prefill": "chunked",
            "params": {"scorer": str(fitting), "threshold": 0.0, "budget_scope": "model"},
        },
        "threshold_decode": {
            "method": "kvzap",
            "budget": 64,
            "params": {"scorer": str(fitting), "threshold": 0.0},
            "decode": {"method": "kvzap", "budget": 48},
        },
        "mixed_chunked": {
            "method": "kvzap",
            "budget": 64,
            "prefill": "chunked",
            "params": {"scorer": str(mixed)},
        },
        "fitting": {"method": "ada-kvzap", "budget": 64, "params": {"scorer": str(fitting)}},
        "decode_none_ships": {"method": "snapkv", "budget": 64, "decode": {"method": "kvzap", "budget": 48}},
        "decode_mixed": {
            "method": "kvzap",
            "budget": 64,
            "params": {"scorer": str(mixed)},  # whole prompts: fine; the decode cap scores it again
            "decode": {"method": "kvzap", "budget": 48},
        },
        "decode_other_model": {
            "method": "kvzap",
            "budget": 64,
            "params": {"scorer": str(fitting)},
            "decode": {"method": "kvzap", "budget": 48, "params": {"scorer": str(other)}},
        },
        "decode_fitting": {
            "method": "snapkv",
            "budget": 64,
            "decode": {"method": "ada-kvzap", "budget": 48, "params": {"scorer": str(fitting)}},
        },
    }
    return run_scenario(
        f"""
        import os
        from vllm_kvevict.policies import served_scorer
        served_scorer.find_packaged_scorer = lambda fingerprint, kind=None: None  # nothing ships
        plugin.register()
        for name, eviction in {scenarios!r}.items():
            try:
                engine_config(os.environ["KVEVICT_TEST_MODEL"], eviction)
                print(json.dumps({{name: {{"error": None, "state": state()}}}}))
            except ValueError as exc:
                print(json.dumps({{name: {{"error": str(exc), "state": state()}}}}))
        """,
        model_dir,
    )


def test_a_model_no_scorer_ships_for_is_refused_in_one_line_naming_calibrate(startups):
    error = startups["none_ships"]["error"]
    assert error.startswith("kv eviction refused: --kv-eviction ada-kvzap: no learned scorer ships for ")
    assert "`vllm-kvevict calibrate MODEL --out DIR`" in error and "\n" not in error
    assert startups["none_ships"]["state"]["cpu_attn"] == VLLM_CPU_ATTN  # nothing installed


def test_a_scorer_fitted_on_another_model_is_refused_naming_the_differing_fields(startups):
    error = startups["other_model"]["error"]
    assert error.startswith("kv eviction refused: --kv-eviction kvzap: scorer ")
    assert "cannot score" in error and "num_hidden_layers=2" in error and "calibrate" in error
    assert "\n" not in error


def test_the_threshold_mode_serves_whole_prompts_and_is_refused_where_it_cannot_be_served(startups):
    assert startups["threshold"]["error"] is None
    assert startups["threshold"]["state"]["cpu_attn"] == EVICTING_CPU_ATTN
    layer = startups["threshold_layer"]["error"]  # the random scorer records no score levels
    assert layer.startswith("kv eviction refused: kvzap with threshold_scope=layer: the scorer of ")
    assert "score_levels MODEL DIR" in layer and "\n" not in layer
    chunked = startups["threshold_chunked"]["error"]
    assert chunked.startswith("kv eviction refused: kvzap with prefill=chunked and threshold=0.0: ")
    assert "prefill: whole" in chunked and "\n" not in chunked
    assert startups["threshold_pooled_chunked"]["error"] is None  # pooled: evicted per chunk too
    assert startups["threshold_decode"]["error"] is None  # the cap follows the reported bound's rule


def test_a_chunked_prefill_with_a_scorer_reading_every_head_is_refused(startups):
    error = startups["mixed_chunked"]["error"]
    assert error.startswith("kv eviction refused: kvzap with prefill=chunked: scorer ")
    assert "prefill: whole" in error and "\n" not in error


def test_a_scorer_that_fits_the_model_serves(startups):
    assert startups["fitting"]["error"] is None
    assert startups["fitting"]["state"]["cpu_attn"] == EVICTING_CPU_ATTN


def test_a_decode_cap_with_kvzap_where_no_scorer_ships_is_refused_naming_calibrate(startups):
    error = startups["decode_none_ships"]["error"]
    assert error.startswith("kv eviction refused: --kv-decode-eviction kvzap: no learned scorer ships for ")
    assert "`vllm-kvevict calibrate MODEL --out DIR`" in error and "\n" not in error


def test_a_decode_cap_with_a_scorer_reading_every_head_is_refused(startups):
    error = startups["decode_mixed"]["error"]
    assert error.startswith("kv eviction refused: --kv-decode-eviction kvzap: scorer ")
    assert "every head's row" in error and "--heads separate" in error and "\n" not in error


def test_a_decode_caps_own_scorer_of_another_model_is_refused(startups):
    error = startups["decode_other_model"]["error"]
    assert error.startswith("kv eviction refused: --kv-decode-eviction kvzap: scorer ")
    assert "cannot score" in error and "num_hidden_layers=2" in error and "calibrate" in error
    assert "\n" not in error


def test_a_decode_cap_with_a_scorer_that_fits_serves(startups):
    assert startups["decode_fitting"]["error"] is None
    assert startups["decode_fitting"]["state"]["cpu_attn"] == EVICTING_CPU_ATTN


def test_the_threshold_mode_is_refused_on_several_workers_in_one_line():
    from types import SimpleNamespace

    from vllm_kvevict.vllm_adapter.learned_scorer import threshold_problem

    one = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    two = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1))
    assert threshold_problem("kvzap", 0.0, one) is None
    error = threshold_problem("kvzap", 0.0, two)
    assert error is not None and "each of the 2 workers" in error and "\n" not in error
