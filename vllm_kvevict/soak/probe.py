"""Reads what a running server shows about itself: ``/metrics``, ``/health``, ``/v1/models``."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class ServerProbe:
    """A server at ``root_url`` (``http://127.0.0.1:PORT``); only loopback addresses are accepted, since the
    soak sends hostile traffic."""

    def __init__(self, root_url: str) -> None:
        host = urllib.parse.urlsplit(root_url).hostname
        if host not in LOOPBACK_HOSTS:
            local = ", ".join(LOOPBACK_HOSTS)
            raise ValueError(f"{root_url!r}: the soak only targets a server on this machine ({local})")
        self.root_url = root_url.rstrip("/").removesuffix("/v1")

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"

    def _get(self, path: str, timeout_s: float = 30.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.root_url + path, timeout=timeout_s) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")

    def health(self) -> int:
        """HTTP status of ``/health`` (0 when the server does not answer)."""
        try:
            return self._get("/health")[0]
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0

    def served_model(self) -> str:
        status, text = self._get("/v1/models")
        if status != 200:
            raise RuntimeError(f"{self.root_url}/v1/models answered {status}: {text[:200]}")
        return str(json.loads(text)["data"][0]["id"])

    def metric_samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """``(labels, value)`` of every sample called exactly ``name``."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self._get("/metrics")[1]
        return [
            (dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        ]

    def metric_sum(self, name: str) -> float:
        return sum(value for _, value in self.metric_samples(name))

    def num_kv_blocks(self) -> int | None:
        """The KV pool in blocks, from vLLM's ``vllm:cache_config_info`` (None when not shown)."""
        for labels, _ in self.metric_samples("vllm:cache_config_info"):
            if labels.get("num_gpu_blocks", "").isdigit():
                return int(labels["num_gpu_blocks"])
        return None
