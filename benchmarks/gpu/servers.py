"""``vllm serve`` from the bundle on the GPU host: the project's server launcher, vLLM run as a module.

The host has no ``vllm`` console script (vLLM is the bundle's tree on ``PYTHONPATH``), so the command is
``python -m vllm.entrypoints.cli.main serve``; everything else (process group, log file, ``/health``,
``/metrics``, stop) is :class:`vllm_kvevict.server_process.VLLMServer`. No CPU set-up: the servers run
on the GPU.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path

from benchmarks.gpu import serve_flags
from vllm_kvevict.server_process import HOST, VLLMServer

MISSING_C_OP = re.compile(r"'_OpNamespace' '_C' object has no attribute '(\w+)'")
#: Two servers share the GPU in the correctness and bench stages.
GPU_MEMORY_SHARE = "0.35"


class BundleServer(VLLMServer):
    """``python -m vllm.entrypoints.cli.main serve MODEL`` with :data:`serve_flags.SERVER_ENV`."""

    def __init__(self, model_dir: Path, args: Iterable[str], log_path: Path, env: dict | None = None,
                 startup_timeout_s: float = 300.0, memory_share: str = GPU_MEMORY_SHARE,
                 served_model_name: str = serve_flags.SERVED_MODEL_NAME) -> None:
        """``memory_share``: the ``--gpu-memory-utilization`` of this server (a shape's bench sizes it from
        the shape, ``shapes.memory_share``); ``served_model_name``: the name requests and results give."""
        args = [*args, "--gpu-memory-utilization", memory_share]
        super().__init__(
            model_dir, extra_args=args, env={**serve_flags.SERVER_ENV, **(env or {})},
            served_model_name=served_model_name, startup_timeout_s=startup_timeout_s,
            log_path=log_path, enforce_eager=False, cpu_setup=False,
        )

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(self.model_dir),
                "--host", HOST, "--port", str(self.port), "--served-model-name", self.served_model_name,
                *self.extra_args]

    def missing_c_ops(self) -> list[str]:
        """``torch.ops._C`` names the server looked up and the bundle's stub lacks (from its log)."""
        if self.log_path is None or not self.log_path.exists():
            return []
        return sorted(set(MISSING_C_OP.findall(self.log_path.read_text(errors="replace"))))


def start_all(stack: ExitStack, servers: list[BundleServer]) -> list[BundleServer]:
    """Launch every server at once (they compile Triton kernels and profile concurrently), then wait for
    each; all are stopped when ``stack`` closes."""
    for server in servers:
        server._launch()
        stack.callback(server.stop)
    for server in servers:
        server._wait_healthy()
    return servers
