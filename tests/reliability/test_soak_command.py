"""``vllm-kvevict soak`` against the suite's server (``--base-url``): a short soak passes and its summary
counts every kind of traffic it sent (issue 13: the soak command)."""

from __future__ import annotations

import re

import pytest

from vllm_kvevict.cli.main import main

pytestmark = [pytest.mark.e2e, pytest.mark.model]


ROW = re.compile(r"^\| (\w+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", re.MULTILINE)


def test_a_short_soak_serves_everything_and_leaves_nothing_behind(server, capsys):
    # 5 clients: each kind of request is sent at least once, however short the soak.
    args = ["soak", "--minutes", "0.3", "--base-url", server.root_url, "--concurrency", "5", "--seed", "3"]
    code = main(args)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "- verdict: PASS" in out
    # per kind: served, aborted, 4xx, 5xx, transport
    rows = {kind: [int(n) for n in counts] for kind, *counts in ROW.findall(out)}
    served, _, client_errors, server_errors, transport = (sum(c) for c in zip(*rows.values(), strict=True))
    assert served > 0 and client_errors > 0 and sum(rows["aborted"]) > 0
    assert rows["invalid"][2] == sum(rows["invalid"]), rows["invalid"]  # every invalid request got a 4xx
    assert server_errors == 0 and transport == 0
    assert "- leaked blocks: 0 " in out
    assert "- worker eviction state left: 0 requests" in out
    assert server.is_running()


def test_soak_refuses_a_server_that_is_not_local(capsys):
    assert main(["soak", "--minutes", "1", "--base-url", "http://10.1.2.3:8000"]) == 2
    assert "only targets a server on this machine" in capsys.readouterr().err
