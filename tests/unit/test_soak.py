"""``vllm-kvevict soak``: what counts as a pass, and its arguments (no server)."""

from __future__ import annotations

import pytest

from vllm_kvevict.cli.main import build_parser
from vllm_kvevict.cli.soak import AfterTraffic, passed
from vllm_kvevict.soak.probe import ServerProbe
from vllm_kvevict.soak.traffic import TrafficCounts

CLEAN = AfterTraffic(usage=0.0, leaked_blocks=0, worker_requests=0.0, preemptions=3, health=200,
                     seconds_to_idle=1.0)


def clean_counts() -> TrafficCounts:
    counts = TrafficCounts()
    counts.record("long", "served")
    counts.record("aborted", "aborted")
    counts.record("invalid", "4xx")
    return counts


def test_a_clean_soak_passes():
    assert passed(clean_counts(), CLEAN, alive=True)


@pytest.mark.parametrize(("kind", "outcome"), [("long", "5xx"), ("streaming", "transport"), ("short", "4xx")])
def test_a_5xx_a_transport_error_or_a_4xx_to_a_valid_request_fails_it(kind, outcome):
    counts = clean_counts()
    counts.record(kind, outcome, "example")
    assert not passed(counts, CLEAN, alive=True)
    assert counts.problems == [f"{kind}: example"]


@pytest.mark.parametrize(
    "after",
    [
        AfterTraffic(0.05, 2, 0.0, 0, 200, 120),  # leaked blocks
        AfterTraffic(0.0, 0, 1.0, 0, 200, 1),  # worker state left
        AfterTraffic(0.0, 0, None, 0, 200, 1),  # worker state not shown
        AfterTraffic(0.0, 0, 0.0, 0, 503, 1),  # unhealthy
    ],
)
def test_anything_left_behind_fails_it(after):
    assert not passed(clean_counts(), after, alive=True)


def test_a_dead_server_fails_it():
    assert not passed(clean_counts(), CLEAN, alive=False)


@pytest.mark.parametrize("minutes", ["0", "-1"])
def test_minutes_must_be_positive(minutes, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["soak", "--minutes", minutes])
    assert f"'{minutes}' must be a positive number of minutes" in capsys.readouterr().err


def test_the_probe_only_accepts_a_local_server():
    assert ServerProbe("http://127.0.0.1:8000/v1").root_url == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="10.0.0.1.*only targets a server on this machine"):
        ServerProbe("http://10.0.0.1:8000")
