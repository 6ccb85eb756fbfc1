"""``VLLMServer.start``: a server is up when ``/health`` answers *and* its own log says it serves on its port,
so a server whose port another server took meanwhile never talks to that other server.

The launched command is a stand-in for ``vllm serve`` (a short Python script that binds its ``--port``, logs
vLLM's start line and answers ``/health``, or exits with "Address already in use"), and the other server is
the standard library's HTTP server: these tests exercise the start-up protocol, not vLLM.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_kvevict import server_process
from vllm_kvevict.server_process import ServerStartError, VLLMServer, free_port

FAKE_VLLM = """
import http.server, socket, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
try:
    server = http.server.HTTPServer(("127.0.0.1", port), http.server.BaseHTTPRequestHandler)
except OSError as error:
    print(f"OSError: [Errno 98] Address already in use ({error})", flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
server.RequestHandlerClass = Health
print(f"INFO [entry.py:140] Starting vLLM server on http://127.0.0.1:{port}", flush=True)
server.serve_forever()
"""


class FakeVLLMServer(VLLMServer):
    """:class:`VLLMServer` launching :data:`FAKE_VLLM` with the same ``--port`` argument."""

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-c", FAKE_VLLM, "--port", str(self.port)]


class Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def other_server() -> Iterator[int]:
    """Another server already answering ``/health`` on a port: the port."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def fake_server(tmp_path, port: int | None) -> FakeVLLMServer:
    (tmp_path / "config.json").write_text("{}")
    return FakeVLLMServer(tmp_path, cpu_setup=False, port=port, startup_timeout_s=30)


def test_a_given_port_held_by_another_server_is_a_start_error_not_that_servers_health(tmp_path, other_server):
    server = fake_server(tmp_path, other_server)
    with pytest.raises(ServerStartError, match="Address already in use"):
        server.start()
    assert not server.is_running()


def test_a_chosen_port_taken_by_another_server_is_retried_on_a_new_one(tmp_path, other_server, monkeypatch):
    ports = iter([other_server])  # free_port() first returns the port the other server took meanwhile
    monkeypatch.setattr(server_process, "free_port", lambda: next(ports, None) or free_port())
    with fake_server(tmp_path, None) as server:
        assert server.port != other_server
        assert server.is_running()
        assert f"Starting vLLM server on {server.root_url}" in server.log_path.read_text()


def test_a_server_on_its_own_port_starts(tmp_path):
    with fake_server(tmp_path, None) as server:
        assert server.is_running() and server._health_ok()


def test_vllm_logging_stays_on_at_info_so_the_start_line_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    quiet = fake_server(tmp_path, 1)
    assert quiet.env["VLLM_CONFIGURE_LOGGING"] == "1"
    warning = FakeVLLMServer(tmp_path, env={"VLLM_LOGGING_LEVEL": "warning"}, cpu_setup=False, port=1)
    assert warning.env["VLLM_LOGGING_LEVEL"] == "INFO"
    debug = FakeVLLMServer(tmp_path, env={"VLLM_LOGGING_LEVEL": "DEBUG"}, cpu_setup=False, port=1)
    assert debug.env["VLLM_LOGGING_LEVEL"] == "DEBUG"
