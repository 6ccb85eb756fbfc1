"""Start and stop a real ``vllm serve`` subprocess, for end-to-end tests, ``bench`` and ``eval --compare``.

The server runs the ``vllm`` console script of the running interpreter's environment in its own process
group (so API server, EngineCore and workers are stopped together), logs to a file, and is ready once
``/health`` answers 200. ``stop()`` sends SIGINT to the group, then SIGKILL to whatever is left.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
HOST = "127.0.0.1"
# Between free_port() and vLLM binding it (tens of seconds of imports) another process may take the port.
PORT_ATTEMPTS = 3
ADDRESS_IN_USE = "Address already in use"
#: What vLLM 0.32's API server logs once it holds its port, right before it serves HTTP
#: (``build_and_serve`` in ``vllm/entrypoints/launchers/api_server/entry.py``; it binds in ``setup_server``).
STARTED_LINE = "Starting vLLM server on {url}"
DEFAULT_STARTUP_TIMEOUT_S = 600.0


class ServerStartError(RuntimeError):
    """``vllm serve`` exited or did not become healthy in time; the message ends with its log tail."""


def vllm_executable() -> Path:
    """The ``vllm`` console script next to ``sys.executable`` (the same virtual environment)."""
    # Not resolved: .venv/bin/python is a symlink to the base interpreter, and the script lives in .venv/bin.
    candidate = Path(sys.executable).parent / "vllm"
    if not candidate.is_file():
        raise FileNotFoundError(
            f"no `vllm` executable next to {sys.executable}; run `make install` to create .venv with vLLM"
        )
    return candidate


def free_port(host: str = HOST) -> int:
    """A TCP port free right now on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member exists but is not ours to signal; treat as alive
        return True
    return True


#: What a server launched with ``enforce_eager=False`` runs, as the bench and eval reports state it.
VLLM_DEFAULTS_TEXT = "vLLM's defaults (compiled model, chunked prefill, prefix caching on)"
EAGER_TEXT = "--enforce-eager on every server (vLLM's default is the compiled model)"
#: torch.compile's warm-up on two busy CPU cores has taken more than 600 s.
COMPILED_STARTUP_TIMEOUT_S = 1800.0


def add_eager_flag(add: Callable[..., object]) -> None:
    """``--eager`` for commands that compare servers (bench, eval --compare): off, every server runs at
    vLLM's defaults, the baseline users compare against."""
    add(
        "--eager",
        action="store_true",
        help="run every server (vanilla too) with --enforce-eager: faster start-up on small CPUs, "
        "not vLLM's default (compiled)",
    )


def server_mode_text(eager: bool) -> str:
    """One line naming how the compared servers run."""
    return EAGER_TEXT if eager else VLLM_DEFAULTS_TEXT


def startup_timeout_for(eager: bool) -> float:
    """Start-up allowance: the default for eager servers, more for torch.compile's warm-up."""
    return DEFAULT_STARTUP_TIMEOUT_S if eager else COMPILED_STARTUP_TIMEOUT_S


class VLLMServer:
    """``vllm serve MODEL --host 127.0.0.1 --port <free> --served-model-name NAME *extra_args`` as a
    context manager.

    ``env`` entries are added to (and override) the inherited environment; ``VLLM_USE_V2_MODEL_RUNNER=0``
    and ``VLLM_CPU_KVCACHE_SPACE=<kv_cache_space_gib>`` are set unless ``env`` overrides them.

    ``enforce_eager`` (default on) adds ``--enforce-eager``: on two CPU cores the torch.compile (inductor)
    warm-up adds minutes to every start, and its bf16 rounding differs from eager mode and HF transformers
    enough to flip near-ties (measured: first-token logprobs -1.906/-1.906 compiled vs -1.81/-1.935 eager
    for the default-system-prompt "capital of France" chat). Benchmarks may turn it off.

    ``cpu_setup`` (default on) applies :mod:`vllm_kvevict.cpu_setup`: ``--dtype`` from the CPU's
    capabilities (unless ``extra_args`` give one), tcmalloc in ``LD_PRELOAD`` when the system has it and, on a
    CPU, ``VLLM_USE_AOT_COMPILE=0`` (a compiled server's restart then loads Inductor's cache).
    """

    def __init__(
        self,
        model_dir: Path | str,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        kv_cache_space_gib: float = 1,
        served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        port: int | None = None,
        log_path: Path | str | None = None,
        enforce_eager: bool = True,
        cpu_setup: bool = True,
    ) -> None:
        if kv_cache_space_gib <= 0:
            raise ValueError(f"kv_cache_space_gib must be > 0 GiB, got {kv_cache_space_gib!r}")
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0 s, got {startup_timeout_s!r}")
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir} is not a model directory (no config.json)")
        self.extra_args = tuple(str(arg) for arg in extra_args)
        if enforce_eager and "--enforce-eager" not in self.extra_args:
            self.extra_args = ("--enforce-eager", *self.extra_args)
        setup_env: dict[str, str] = {}
        if cpu_setup:
            from vllm_kvevict.cpu_setup import cpu_setup as machine_setup

            setup = machine_setup()
            self.extra_args = (*setup.server_args(self.extra_args), *self.extra_args)
            setup_env = setup.server_env({**os.environ, **(dict(env) if env else {})})
        for reserved in ("--host", "--port", "--served-model-name"):
            if any(arg == reserved or arg.startswith(reserved + "=") for arg in self.extra_args):
                raise ValueError(f"{reserved} is set by VLLMServer; pass it to the constructor instead")
        self.served_model_name = served_model_name
        self.startup_timeout_s = startup_timeout_s
        self.port = port if port is not None else free_port()
        self._port_chosen_here = port is None
        self.env = {
            "VLLM_USE_V2_MODEL_RUNNER": "0",
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_space_gib:g}",
            **(dict(env) if env else {}),
            **setup_env,
        }
        # start() reads vLLM's INFO start line (STARTED_LINE) from the log: vLLM logs at INFO or below.
        inherited = {**os.environ, **self.env}
        if inherited.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
            self.env["VLLM_CONFIGURE_LOGGING"] = "1"
        if inherited.get("VLLM_LOGGING_LEVEL", "INFO").upper() not in ("DEBUG", "INFO"):
            self.env["VLLM_LOGGING_LEVEL"] = "INFO"
        # Chosen at start() when not given, so that an unstarted launcher leaves no file behind.
        self.log_path: Path | None = Path(log_path) if log_path is not None else None
        self._log_path_chosen_here = False
        self._process: subprocess.Popen[bytes] | None = None

    # -- addresses ---------------------------------------------------------------------------------------
    @property
    def root_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL, e.g. ``http://127.0.0.1:PORT/v1``."""
        return f"{self.root_url}/v1"

    @property
    def command(self) -> list[str]:
        return [
            str(vllm_executable()),
            "serve",
            str(self.model_dir),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--served-model-name",
            self.served_model_name,
            *self.extra_args,
        ]

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> VLLMServer:
        """Launch the server and block until ``/health`` is 200 and its log says it serves on its port;
        raise :class:`ServerStartError` otherwise.

        If the port was chosen here and another process took it before vLLM bound it, retry on a new port.
        """
        if self._process is not None:
            raise RuntimeError(f"server on port {self.port} was already started")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._launch()
            try:
                self._wait_healthy()
                return self
            except ServerStartError:
                self.stop()
                port_taken = ADDRESS_IN_USE in self.log_tail()
                if not (self._port_chosen_here and port_taken and attempt < PORT_ATTEMPTS):
                    raise
                self.port = free_port()
                self._process = None
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _launch(self) -> None:
        if self.log_path is None or self._log_path_chosen_here:
            fd, name = tempfile.mkstemp(prefix=f"vllm-serve-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
            self._log_path_chosen_here = True
        with self.log_path.open("wb") as log:
            preload = self.env.get("LD_PRELOAD")
            if preload:
                log.write(f"$ export LD_PRELOAD={preload}\n".encode())
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        atexit.register(self.stop)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            code = self._process.poll()
            if code is not None:
                raise ServerStartError(
                    f"`vllm serve` exited with code {code} before becoming healthy (log {self.log_path}):\n"
                    + self.log_tail()
                )
            # /health alone is not enough: until this server fails to bind a port another server took
            # between free_port() and the bind, that other server answers it.
            if self._health_ok() and self._serving_here():
                return
            time.sleep(0.5)
        raise ServerStartError(
            f"`vllm serve` not healthy after {self.startup_timeout_s:g} s (log {self.log_path}):\n"
            + self.log_tail()
        )

    def _health_ok(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.root_url}/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _serving_here(self) -> bool:
        """Whether this server's own log says it bound its port and serves HTTP on it."""
        assert self.log_path is not None
        try:
            log = self.log_path.read_text(errors="replace")
        except OSError:
            return False
        return STARTED_LINE.format(url=self.root_url) in log

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT the process group, SIGKILL it after ``timeout_s``; returns the server's exit code."""
        process = self._process
        if process is None:
            return None
        atexit.unregister(self.stop)
        pgid = process.pid  # start_new_session makes the server its group leader
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGINT)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # The API server may be gone while EngineCore/workers (same group) are still shutting down.
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline and process.poll() is not None:
            time.sleep(0.1)
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        return process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- observation -------------------------------------------------------------------------------------
    def log_tail(self, max_lines: int = 60) -> str:
        """The last ``max_lines`` lines of the server log."""
        if self.log_path is None:
            return "(server not started: no log yet)"
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError as error:
            return f"(log {self.log_path} unreadable: {error})"
        return "\n".join(lines[-max_lines:])

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        """The Prometheus text of ``GET /metrics``."""
        with urllib.request.urlopen(f"{self.root_url}/metrics", timeout=timeout_s) as response:
            return response.read().decode()

    def metric_samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """``(labels, value)`` of every sample called exactly ``name`` on ``/metrics``."""
        from prometheus_client.parser import text_string_to_metric_families

        return [
            (dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(self.metrics_text())
            for sample in family.samples
            if sample.name == name
        ]

    def metric_value(self, name: str) -> float:
        """The value of the one sample called ``name`` (e.g. ``vllm:kv_cache_usage_perc``)."""
        samples = self.metric_samples(name)
        if len(samples) != 1:
            found = [labels for labels, _ in samples]
            raise LookupError(f"expected one sample {name!r} on /metrics, found {len(samples)}: {found}")
        return samples[0][1]

    def wait_for_metric(
        self, name: str, expected: float = 0.0, timeout_s: float = 60.0, poll_s: float = 0.5
    ) -> float:
        """Read ``metric_value(name)`` every ``poll_s`` until it equals ``expected`` or ``timeout_s`` passes;
        returns the last value read (e.g. usage back to 0 once every request is done)."""
        deadline = time.monotonic() + timeout_s
        value = self.metric_value(name)
        while value != expected and time.monotonic() < deadline:
            time.sleep(poll_s)
            value = self.metric_value(name)
        return value
