"""The one message from worker to scheduler (``runner_hooks.sample_tokens``, ``update_from_output``): the
kept bounds of adaptive plans ride on the step's ``ModelRunnerOutput`` (inside an async output too), never on
vLLM's shared empty output, and reach every evicting manager before vLLM processes the step."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from vllm_kvevict.datapath.records import EvictionRecords
from vllm_kvevict.vllm_adapter import runner_hooks
from vllm_kvevict.vllm_adapter.vllm_private import hold_runner_worker


def runner_with_bounds(bounds: dict[str, int]) -> SimpleNamespace:
    records = EvictionRecords(num_kv_heads=3)
    records.kept_bounds.update(bounds)
    runner = SimpleNamespace()
    hold_runner_worker(runner, SimpleNamespace(records=records))
    return runner


def test_the_bounds_ride_on_the_steps_output_once() -> None:
    runner = runner_with_bounds({"a": 96})
    output = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    assert runner_hooks.sample_tokens(lambda _runner: output, runner) is output
    assert getattr(output, runner_hooks.KEPT_BOUNDS) == {"a": 96}
    later = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    runner_hooks.sample_tokens(lambda _runner: later, runner)
    assert not hasattr(later, runner_hooks.KEPT_BOUNDS)


def test_an_async_output_carries_them_on_the_output_it_holds() -> None:
    runner = runner_with_bounds({"a": 96})
    inner = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    wrapped = SimpleNamespace(_model_runner_output=inner)
    runner_hooks.sample_tokens(lambda _runner: wrapped, runner)
    assert getattr(inner, runner_hooks.KEPT_BOUNDS) == {"a": 96}


def test_the_shared_empty_output_is_never_written_and_the_next_output_carries_them() -> None:
    runner = runner_with_bounds({"a": 96})
    runner_hooks.sample_tokens(lambda _runner: EMPTY_MODEL_RUNNER_OUTPUT, runner)
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, runner_hooks.KEPT_BOUNDS)
    output = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    runner_hooks.sample_tokens(lambda _runner: output, runner)
    assert getattr(output, runner_hooks.KEPT_BOUNDS) == {"a": 96}


def test_the_scheduler_hands_them_to_every_evicting_manager_before_processing() -> None:
    noted, order = [], []
    evicting = SimpleNamespace(note_kept_bounds=lambda bounds: (noted.append(bounds), order.append("note")))
    plain = SimpleNamespace()  # a manager of another spec: no such method
    scheduler = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=[plain, evicting]))
    )
    output = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    setattr(output, runner_hooks.KEPT_BOUNDS, {"a": 96})
    runner_hooks.update_from_output(lambda *_: order.append("vllm"), scheduler, None, output)
    assert noted == [{"a": 96}] and order == ["note", "vllm"]
