"""Configuration names, kvpress output scoring and the report written from results files (no servers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_kvevict.evaluation.compare import server_args, server_configs, write_report
from vllm_kvevict.evaluation.configs import EvalConfig
from vllm_kvevict.evaluation.kvpress_bridge import kvpress_configs, score_raw
from vllm_kvevict.evaluation.report import BEGIN, END
from vllm_kvevict.evaluation.results import Result, overall_score, summary_table, write_results
from vllm_kvevict.evaluation.sample import Sample, write_samples


def _sample(task: str, index: int, answers: tuple[str, ...]) -> Sample:
    return Sample(
        id=f"{task}-1024-{index}",
        task=task,
        target_tokens=1024,
        seed=index,
        prompt="p",
        prompt_tokens=1024,
        context_tokens=1000,
        answers=answers,
        metric="all",
        max_new_tokens=8,
    )


SAMPLES = [_sample("niah_single_noise", 0, ("1234567",)), _sample("niah_multivalue", 0, ("11", "22"))]


def _results(config: str, outputs: list[str]) -> list[Result]:
    return [
        Result(
            config=config,
            sample_id=s.id,
            task=s.task,
            target_tokens=1024,
            prompt_tokens=1024,
            served_prompt_tokens=1024,
            output=o,
            answers=s.answers,
            score=sum(a in o for a in s.answers) / len(s.answers),
            latency_s=0.1,
        )
        for s, o in zip(SAMPLES, outputs, strict=True)
    ]


@pytest.mark.parametrize(
    "config",
    [
        EvalConfig("vllm", "vanilla", 1.0),
        EvalConfig("vllm", "ada-snapkv", 0.25),
        EvalConfig("kvpress", "critical-ada-snapkv", 0.05, "agnostic"),
        EvalConfig("kvpress", "none", 1.0),
    ],
)
def test_configuration_names_parse_back(config: EvalConfig):
    assert EvalConfig.parse(config.name) == config


def test_configuration_names_read_as_documented():
    assert EvalConfig("vllm", "snapkv", 0.1).name == "vllm-snapkv-0.1"
    assert EvalConfig("kvpress", "snapkv", 0.5, "aware").name == "kvpress-snapkv-aware-0.5"


def test_bad_configurations_name_the_bad_value():
    with pytest.raises(ValueError, match="unknown mode 'blind'; valid modes: aware, agnostic"):
        EvalConfig("kvpress", "snapkv", 0.5, "blind")
    with pytest.raises(ValueError, match="kept fraction 1.5"):
        EvalConfig("vllm", "snapkv", 1.5)
    with pytest.raises(ValueError, match="bad configuration name 'hf-snapkv'"):
        EvalConfig.parse("hf-snapkv")


def test_server_configs_are_vanilla_then_every_method_and_budget():
    names = [c.name for c in server_configs(["snapkv", "ada-snapkv"], [0.5, 0.1])]
    assert names == [
        "vllm-vanilla",
        "vllm-snapkv-0.5",
        "vllm-snapkv-0.1",
        "vllm-ada-snapkv-0.5",
        "vllm-ada-snapkv-0.1",
    ]


def test_every_server_gets_the_block_size_and_eviction_servers_their_method():
    vanilla, snapkv = server_configs(["snapkv"], [0.05])
    assert server_args(vanilla, 32) == ("--block-size", "32")
    assert server_args(snapkv, 32) == ("--block-size", "32", "--kv-eviction", "snapkv", "--kv-budget", "0.05")
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        server_args(snapkv, 0)


def test_a_bad_block_size_stops_eval_before_any_server_starts(capsys: pytest.CaptureFixture[str]):
    from vllm_kvevict.cli.main import main

    assert main(["eval", "--compare", "--methods", "snapkv", "--block-size", "0"]) == 2
    assert "--block-size must be >= 1, got 0" in capsys.readouterr().err


def test_kvpress_configs_reject_an_unknown_press():
    with pytest.raises(ValueError, match="unknown kvpress press 'h2o'; valid presses: snapkv"):
        kvpress_configs(["h2o"], [0.5], ["aware"])


def test_overall_score_weighs_every_task_equally():
    results = _results("vllm-vanilla", [" 1234567.", " 11 and 33"])
    assert overall_score(results) == pytest.approx((1.0 + 0.5) / 2)
    assert "| niah_multivalue | 50.0 | 50.0 |" in summary_table(results)


def test_failed_requests_are_not_scored_and_are_counted():
    failed = Result(
        config="c",
        sample_id="x",
        task="niah_single_noise",
        target_tokens=1024,
        prompt_tokens=1024,
        served_prompt_tokens=None,
        output="",
        answers=("1",),
        score=None,
        latency_s=1.0,
        error="APIConnectionError: refused",
    )
    assert overall_score([failed]) is None
    assert "1 of 1 requests failed" in summary_table([failed])


def _kvpress_raw_lines(outputs: list[str]) -> str:
    """The kvpress script's raw output for SAMPLES: one JSON line per sample, answer ``outputs[i]``."""
    return "\n".join(
        json.dumps(
            {
                "config": "kvpress-snapkv-aware-0.5",
                "sample_id": sample.id,
                "output": output,
                "prompt_tokens": 1024,
                "kept_tokens": 512,
                "latency_s": 1.0,
            }
        )
        for sample, output in zip(SAMPLES, outputs, strict=True)
    )


def test_kvpress_raw_outputs_are_scored_against_the_samples(tmp_path: Path):
    raw = tmp_path / "kvpress-snapkv-aware-0.5.raw.jsonl"
    raw.write_text(_kvpress_raw_lines([" 1234567.", " 22."]))
    results = score_raw(raw, SAMPLES)
    assert [r.score for r in results] == [1.0, 0.5]


def test_report_has_tables_plots_and_keeps_hand_written_text(tmp_path: Path):
    results_dir = tmp_path / "results"
    results_dir.mkdir()
    write_samples(results_dir / "samples.jsonl", SAMPLES)
    write_results(results_dir / "vllm-vanilla.jsonl", _results("vllm-vanilla", [" 1234567", " 11 22"]))
    write_results(results_dir / "vllm-snapkv-0.5.jsonl", _results("vllm-snapkv-0.5", [" 1234567", " 11"]))
    raw_dir = results_dir / "kvpress-raw"
    raw_dir.mkdir()
    (raw_dir / "kvpress-snapkv-aware-0.5.raw.jsonl").write_text(_kvpress_raw_lines([" 7", " 11"]))
    report = tmp_path / "docs" / "quality.md"
    report.parent.mkdir()
    report.write_text(
        f"# Quality\n\nHand-written intro.\n\n{BEGIN}\nold numbers\n{END}\n\n## Analysis\nkept.\n"
    )
    img = tmp_path / "docs" / "img"
    write_report(results_dir, report, img, "vllm-kvevict eval --compare", "eager servers")
    text = report.read_text()
    assert "Hand-written intro." in text and "## Analysis\nkept." in text and "old numbers" not in text
    assert "Servers: eager servers." in text
    assert "| full cache | ours (vLLM) | 100.0 |" in text
    assert "| snapkv | ours (vLLM) | – | 75.0 |" in text
    assert "| snapkv | kvpress (aware) | – | 25.0 |" in text
    assert "![quality_vs_kept](img/quality_vs_kept.png)" in text
    for png in ("quality_vs_kept.png", "quality_tasks_heatmap.png"):
        assert (tmp_path / "docs" / "img" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eviction_evidence_sums_the_plugins_counters_over_labels():
    from vllm_kvevict.evaluation.compare import eviction_evidence

    text = "\n".join(
        [
            "# TYPE vllm_kvevict_requests_compacted counter",
            'vllm_kvevict_requests_compacted_total{method="snapkv"} 3.0',
            "# TYPE vllm_kvevict_tokens_kept counter",
            "vllm_kvevict_tokens_kept_total 1536.0",
            "# TYPE vllm_kvevict_tokens_evicted counter",
            "vllm_kvevict_tokens_evicted_total 1536.0",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{model_name="m"} 0.0',
            "",
        ]
    )
    assert eviction_evidence(text) == {
        "requests_compacted": 3.0,
        "tokens_kept": 1536.0,
        "tokens_evicted": 1536.0,
    }
    assert eviction_evidence("# TYPE x counter\nx_total 1.0\n") == {}
