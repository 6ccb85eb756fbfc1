"""Timing and table output shared by the kernel benchmarks (torch + triton only; no vLLM)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script from anywhere, without installing the package
    sys.path.insert(0, str(REPO))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def time_graph_ms(
    fn: Callable[[], object], device: torch.device, calls: int = 10, repeats: int = 10
) -> float:
    """Median ms of one ``fn`` call replayed from a CUDA graph of ``calls`` back-to-back calls: the GPU time
    of the kernels without the host's launch gaps, as vLLM's decode runs them (captured graphs)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm up (Triton compiles, allocator pools) off the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_ms(graph.replay, device, warmup=2, repeats=repeats) / calls


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script runs (CPU)")
    return parser


def emit_table(
    title: str, header: list[str], rows: list[list[object]], device: torch.device, out: Path | None
):
    """Print an aligned table; with ``out``, append it as Markdown with the device named."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    print(f"\n{title} on {device_name(device)}, torch {torch.__version__}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    if out is not None:
        lines = [f"### {title}", "", f"Device: {device_name(device)}, torch {torch.__version__}", ""]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---:" for _ in header) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write("\n".join(lines) + "\n\n")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
