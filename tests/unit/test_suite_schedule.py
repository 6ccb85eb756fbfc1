"""The suite's xdist schedule (tests/suite_schedule.py): scopes exist; the reliability files share one."""

from __future__ import annotations

from pathlib import Path

from suite_schedule import ONE_SCOPE, SLOWEST_FIRST, schedule_rank, scope_of

REPO = Path(__file__).resolve().parents[2]


def test_every_listed_scope_exists_so_the_order_is_not_stale():
    assert [scope for scope in (*SLOWEST_FIRST, *ONE_SCOPE) if not (REPO / scope).exists()] == []


def test_reliability_files_are_one_scope_and_other_modules_their_own():
    assert scope_of("tests/reliability/test_preemption.py::test_x") == "tests/reliability"
    assert scope_of("tests/reliability/test_soak_command.py::test_y[a]") == "tests/reliability"
    assert scope_of("tests/e2e/test_eval_cli.py::test_z") == "tests/e2e/test_eval_cli.py"


def test_listed_scopes_come_before_unlisted_ones_in_their_listed_order():
    ranks = [
        schedule_rank(f"{scope}/x.py::t" if scope in ONE_SCOPE else f"{scope}::t") for scope in SLOWEST_FIRST
    ]
    assert ranks == sorted(ranks) == list(range(len(SLOWEST_FIRST)))
    assert schedule_rank("tests/unit/test_prepare_model.py::t") == len(SLOWEST_FIRST)
