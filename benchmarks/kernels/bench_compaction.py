"""Compaction bandwidth: CUDA op / Triton / torch vs a plain device copy of the same bytes.

A step compacts every layer of a batch of just-prefilled requests: per layer and KV head the kept rows
(``--kept`` of the prompt) move from scattered slots to the front of the request's sub-blocks, K and V
together. Compaction stages through a buffer (sources and destinations overlap), so it reads and writes each
kept row twice; "traffic GB/s" counts those bytes, "useful GB/s" counts each kept row once. The copy
baseline is ``dst.copy_(src)`` of one contiguous tensor of the kept bytes (read once, written once).
Target (issue 6): compaction traffic bandwidth >= 70% of the copy's.

    python benchmarks/kernels/bench_compaction.py                # GPU
    python benchmarks/kernels/bench_compaction.py --smoke        # CPU check that it runs
"""

from __future__ import annotations

import torch
from bench_common import base_parser, emit_table, time_ms

from vllm_kvevict.layout.kernels import dispatch


def build_step(
    requests: int,
    prompt: int,
    kept: float,
    layers: int,
    heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
):
    """Layer caches [2, S, bs, D] and the moves of one compaction step over all requests and layers."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = -(-prompt // block_size)
    num_subblocks = requests * blocks_per_request * heads
    caches = [
        torch.randn(2, num_subblocks, block_size, head_size, dtype=dtype, device=device)
        for _ in range(layers)
    ]
    # request r owns sub-blocks r*bpr*H .. (r+1)*bpr*H - 1; head h of it every H-th one, shuffled
    keep = int(prompt * kept)
    tokens = torch.arange(prompt)
    src, dst, layer_idx = [], [], []
    for layer in range(layers):
        for r in range(requests):
            owned = r * blocks_per_request * heads + torch.randperm(blocks_per_request * heads, generator=gen)
            for h in range(heads):
                subblocks = owned[h::heads]
                kept_tokens = torch.sort(torch.randperm(prompt, generator=gen)[:keep]).values
                slots = subblocks[tokens // block_size] * block_size + tokens % block_size
                src.append(slots[kept_tokens])
                dst.append(slots[:keep])
                layer_idx.append(torch.full((keep,), layer))
    moves = [torch.cat(t).to(device) for t in (src, dst, layer_idx)]
    return caches, *moves


def measure_step(
    args,
    requests: int,
    prompt: int,
    kept: float,
    backends: list[str],
    device: torch.device,
    dtype: torch.dtype,
) -> list[object]:
    """One table row: the copy baseline and every backend on the same step."""
    caches, src, dst, layer_idx = build_step(
        requests, prompt, kept, args.layers, args.heads, args.head_size, args.block_size, dtype, device
    )
    useful = src.numel() * 2 * args.head_size * caches[0].element_size()  # K and V rows
    copy_src = torch.empty(useful, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = time_ms(lambda: copy_dst.copy_(copy_src), device, repeats=args.repeats)
    copy_gbs = 2 * useful / copy_ms / 1e6
    row: list[object] = [requests, prompt, kept, args.layers, f"{useful / 2**20:.1f}", copy_gbs]
    for backend in backends:
        # validation synchronises with the device: time the kernels, not the checks (torch always checks)
        ms = time_ms(
            lambda b=backend: dispatch.compact_subblocks(
                caches, src, dst, layer_idx, backend=b, validate=b == "torch"
            ),
            device,
            repeats=args.repeats,
        )
        traffic_gbs = 4 * useful / ms / 1e6
        row += [ms, traffic_gbs, traffic_gbs / copy_gbs]
    return row


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--kept", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.heads, args.head_size, args.requests, args.prompt, args.kept = (
            2,
            2,
            64,
            [2],
            [256],
            [0.25],
        )
        args.repeats = 2
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    backends = [b for b in ("cuda", "triton", "torch") if dispatch.unavailable_reason(b, device) is None]
    rows = [
        measure_step(args, requests, prompt, kept, backends, device, dtype)
        for requests in args.requests
        for prompt in args.prompt
        for kept in args.kept
    ]
    header = ["requests", "prompt", "kept", "layers", "kept MiB", "copy GB/s"]
    for backend in backends:
        header += [f"{backend} ms", f"{backend} GB/s", f"{backend}/copy"]
    emit_table(
        "Compaction bandwidth (traffic = 2 reads + 2 writes per kept row)",
        header,
        rows,
        device,
        args.markdown,
    )


if __name__ == "__main__":
    main()
