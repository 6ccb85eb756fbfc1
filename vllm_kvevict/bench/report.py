"""Results per server, the ratio table vs vanilla, and the markdown that goes to docs/benchmarks.md."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from vllm_kvevict.bench.client import RunTiming
from vllm_kvevict.bench.metrics_poller import Peaks

CAPACITY_HEADING = "## Capacity and throughput"


@dataclass(frozen=True)
class ServerResult:
    """One server's run: ``label`` is "vanilla" or e.g. "ada-snapkv @ 0.25"."""

    label: str
    max_running: float
    max_kv_usage: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    latency_mean_s: float
    num_requests: int
    wall_s: float
    mean_running: float = 0.0  # running requests averaged over the run (long outputs)
    preemptions: float = 0.0  # vllm:num_preemptions_total at the end of the run
    max_kv_usage_decoding: float = 0.0  # peak KV usage while only decoding (Peaks)
    prompt_tok_s: float = 0.0  # prompt tokens / the last request's TTFT (all requests sent at once)


def percentile(values: list[float], q: int) -> float:
    """Linearly interpolated percentile, q an integer in [1, 99]."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarise(label: str, timing: RunTiming, peaks: Peaks) -> ServerResult:
    ttfts = [request.ttft_s for request in timing.requests]
    return ServerResult(
        label=label,
        max_running=peaks.max_running,
        max_kv_usage=peaks.max_kv_usage,
        output_tok_s=timing.output_tokens / timing.wall_s,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        latency_mean_s=statistics.fmean(request.latency_s for request in timing.requests),
        num_requests=len(timing.requests),
        wall_s=timing.wall_s,
        mean_running=peaks.mean_running,
        preemptions=peaks.preemptions,
        max_kv_usage_decoding=peaks.max_kv_usage_decoding,
        prompt_tok_s=sum(r.prompt_tokens for r in timing.requests) / max(ttfts) if max(ttfts) > 0 else 0.0,
    )


def ratio_table(results: list[ServerResult]) -> str:
    """Markdown table; the first row is the baseline every ratio refers to."""
    base = results[0]
    lines = [
        "| server | max running | × | output tok/s | × | TTFT p50 s | × | TTFT p95 s | × "
        "| peak KV usage | wall s | peak KV usage decoding | prompt tok/s | × |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.label} | {r.max_running:.0f} | {r.max_running / base.max_running:.2f} "
            f"| {r.output_tok_s:.1f} | {r.output_tok_s / base.output_tok_s:.2f} "
            f"| {r.ttft_p50_s:.2f} | {r.ttft_p50_s / base.ttft_p50_s:.2f} "
            f"| {r.ttft_p95_s:.2f} | {r.ttft_p95_s / base.ttft_p95_s:.2f} "
            f"| {r.max_kv_usage:.1%} | {r.wall_s:.0f} | {r.max_kv_usage_decoding:.1%} "
            f"| {r.prompt_tok_s:.0f} | {r.prompt_tok_s / base.prompt_tok_s if base.prompt_tok_s else 0:.2f} |"
        )
    return "\n".join(lines)


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = []
    for dist in ("vllm", "torch"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    system = f"{platform.system()} {platform.release()}"
    return f"{cpu}, {os.cpu_count()} logical CPUs, {system}; {', '.join(versions)}"


def markdown_section(results: list[ServerResult], settings: str, command: str, machine: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"### Run of {stamp}\n\n"
        f"- Machine: {machine}\n"
        f"- Settings: {settings}\n"
        f"- Command: `{command}`\n\n"
        f"{ratio_table(results)}\n"
    )


def append_to_benchmarks(path: Path, section: str) -> None:
    """Add the run under the capacity heading (created if absent), keeping every other section as it is."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if CAPACITY_HEADING not in text:
        text = text.rstrip("\n") + f"\n\n{CAPACITY_HEADING}\n"
    start = text.index(CAPACITY_HEADING)
    next_heading = text.find("\n## ", start + len(CAPACITY_HEADING))
    end = len(text) if next_heading == -1 else next_heading + 1
    body = text[start:end].rstrip("\n") + "\n\n" + section
    path.write_text(text[:start] + body + ("\n" + text[end:] if end < len(text) else ""))
