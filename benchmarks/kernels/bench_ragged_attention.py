"""Ragged per-head paged decode attention vs dense attention (torch SDPA) at equal KV bytes.

For each (batch, context, budget) every (request, KV head) keeps on average budget x context tokens, with
per-head lengths spread by +-``--spread`` around that average (Ada-KV-like; the total is exact), stored in
shuffled sub-blocks. The dense baseline holds exactly budget x context tokens per head in contiguous
[B, H, L, D] tensors (the same KV bytes) and runs ``scaled_dot_product_attention`` with GQA, on the first
fused SDPA kernel that takes the shapes (flash, cuDNN, memory-efficient; the "dense SDPA" column names it).
"ragged/dense" is dense time / ragged time, i.e. the ragged kernel's throughput relative to dense.
Target (issue 6): >= 0.9.

    python benchmarks/kernels/bench_ragged_attention.py          # GPU, full grid (skips KV over --max-gib)
    python benchmarks/kernels/bench_ragged_attention.py --smoke  # CPU check that it runs
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bench_common import base_parser, emit_table, time_graph_ms, time_ms

from vllm_kvevict.layout.kernels import reference
from vllm_kvevict.triton_kernels.paged_attention import ragged_paged_attention


def ragged_lengths(num_seqs: int, average: int, spread: float, gen: torch.Generator) -> torch.Tensor:
    """[num_seqs] int32 lengths in [1, average * (1 + spread) + 1] whose sum is exactly num_seqs * average.

    The rounding error of the draw (hundreds of tokens per sequence at large batches) is spread over the
    sequences, a little each, so no single sequence ends up far longer than the spread allows."""
    ceiling = int(average * (1 + spread)) + 1
    lengths = (
        (average * (1 + spread * (2 * torch.rand(num_seqs, generator=gen) - 1))).round().clamp(1, ceiling)
    )
    lengths = lengths.long()
    while (excess := int(lengths.sum()) - num_seqs * average) != 0:
        room = lengths - 1 if excess > 0 else ceiling - lengths  # how far each may move
        movable = torch.nonzero(room > 0).flatten()
        step = max(1, abs(excess) // len(movable))
        change = torch.minimum(room[movable], torch.tensor(step))[: abs(excess)]
        lengths[movable[: len(change)]] -= change if excess > 0 else -change
    return lengths.to(torch.int32)


def build_ragged(lengths: torch.Tensor, head_size: int, block_size: int, dtype, device, gen: torch.Generator):
    """Shuffled sub-block cache holding the given per-sequence lengths: (k, v, tables)."""
    counts = (lengths.long() + block_size - 1) // block_size
    total = int(counts.sum())
    ids = torch.randperm(total, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lengths), int(counts.max()), dtype=torch.int32)
    starts = torch.cumsum(counts, 0) - counts
    columns = torch.arange(tables.shape[1])
    used = columns[None, :] < counts[:, None]
    tables[used] = ids[(starts[:, None] + columns[None, :])[used]]
    k = torch.randn(total, block_size, head_size, dtype=dtype, device=device)
    v = torch.randn_like(k)
    return k, v, tables.to(device)


def time_ragged(args, lengths: torch.Tensor, device, dtype, gen) -> tuple[float, str]:
    """Median ms of one decode step over the ragged paged cache, best over the ``--tile`` x ``--splits``
    configurations, and that configuration (each checked against the reference with --check)."""
    batch_heads, d = len(lengths), args.head_size
    k, v, tables = build_ragged(lengths, d, args.block_size, dtype, device, gen)
    seq_lens = lengths.to(device)
    query = torch.randn(batch_heads, args.group, d, dtype=dtype, device=device)
    starts = torch.arange(batch_heads + 1, dtype=torch.int32, device=device)
    max_len = int(lengths.max())

    def ragged(tile: tuple[int, int] | None, splits: int | None):
        block_n, num_warps = tile or (None, None)
        return ragged_paged_attention(
            query,
            k,
            v,
            tables,
            seq_lens,
            starts,
            max_query_len=1,
            max_seq_len=max_len,
            num_splits=splits,
            block_n=block_n,
            num_warps=num_warps,
        )

    configs = [(tile, splits) for tile in args.tile for splits in args.splits]
    if args.check:
        want = reference.ragged_paged_attention(query, k, v, tables, seq_lens)
        for tile, splits in configs:
            torch.testing.assert_close(ragged(tile, splits).float(), want.float(), atol=2e-2, rtol=2e-2)
    timings = [(timer(args, device)(lambda c=c: ragged(*c)), c) for c in configs]
    if len(configs) > 1:  # every configuration's time, for retuning (the table keeps only the best)
        print(
            f"  {batch_heads} sequences, longest {max_len}: "
            + ", ".join(f"{c}: {ms:.4f} ms" for ms, c in timings)
        )
    best_ms, (best_tile, best_splits) = min(timings, key=lambda x: x[0])
    tile = "default" if best_tile is None else f"{best_tile[0]}x{best_tile[1]}"
    return best_ms, tile if best_splits is None else f"{tile}, {best_splits} splits"


def timer(args, device):
    """ms of one call: from CUDA graph replays with --cuda-graph, else eager launches (host gaps included)."""
    if args.cuda_graph:
        return lambda fn: time_graph_ms(fn, device, repeats=args.repeats)
    return lambda fn: time_ms(fn, device, repeats=args.repeats)


def parse_splits(text: str) -> int | None:
    """ "4" -> 4 key-range splits; "auto" -> None (choose_num_splits)."""
    return None if text == "auto" else int(text)


def parse_tile(text: str) -> tuple[int, int] | None:
    """ "64x8" -> (BLOCK_N 64, 8 warps); "default" -> None (tile_config's choice)."""
    if text == "default":
        return None
    block_n, _, warps = text.partition("x")
    return int(block_n), int(warps)


# fused SDPA kernels, best first; the math fallback (unfused, far slower) would flatter the ragged kernel
FUSED_SDPA = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def time_dense(args, batch: int, length: int, device, dtype) -> tuple[float, str]:
    """Median ms of SDPA decode over contiguous [B, H, length, D] keys and values (GQA), and the SDPA
    kernel that ran it: the first fused one that accepts the shapes, else torch's default choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, d = args.kv_heads, args.head_size
    q = torch.randn(batch, heads * args.group, 1, d, dtype=dtype, device=device)
    k = torch.randn(batch, heads, length, d, dtype=dtype, device=device)
    v = torch.randn_like(k)

    def dense():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    for name in FUSED_SDPA if device.type == "cuda" else ():
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                dense()
                return timer(args, device)(dense), name.split("_")[0].lower()
        except (RuntimeError, AttributeError):  # this kernel does not take these shapes/dtype
            continue
    return timer(args, device)(dense), "default"


def measure(args, batch: int, context: int, budget: float, device, dtype, gen) -> list[object] | None:
    average = max(1, int(context * budget))
    kv_gib = 2 * batch * args.kv_heads * average * args.head_size * torch.finfo(dtype).bits / 8 / 2**30
    if kv_gib > args.max_gib:
        return None
    lengths = ragged_lengths(batch * args.kv_heads, average, args.spread, gen)
    ragged_ms, tile = time_ragged(args, lengths, device, dtype, gen)
    dense_ms, dense_kernel = time_dense(args, batch, average, device, dtype)
    kv_bytes = kv_gib * 2**30
    return [
        batch,
        context,
        budget,
        average,
        int(lengths.max()),
        f"{kv_gib:.2f}",
        dense_ms,
        ragged_ms,
        kv_bytes / ragged_ms / 1e6,
        dense_ms / ragged_ms,
        tile,
        dense_kernel,
    ]


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 16384, 32768, 131072])
    parser.add_argument("--budget", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5])
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--spread", type=float, default=0.5, help="per-head length spread around the average")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and sub-block order")
    parser.add_argument("--max-gib", type=float, default=20.0, help="skip configs whose KV exceeds this")
    parser.add_argument("--check", action="store_true", help="compare with the torch reference first (slow)")
    parser.add_argument(
        "--splits",
        type=parse_splits,
        nargs="+",
        default=[None],
        help="key-range splits to try (e.g. auto 1 4 16); the best is reported with its tile",
    )
    parser.add_argument(
        "--cuda-graph", action="store_true", help="time both kernels as CUDA graph replays (no launch gaps)"
    )
    parser.add_argument(
        "--tile",
        type=parse_tile,
        nargs="+",
        default=[None],
        help="tiles to try, BLOCK_NxWARPS (e.g. 32x4 64x4 64x8 128x8) or default; the best is reported",
    )
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.context, args.budget, args.kv_heads, args.head_size = [2], [512], [0.25], 2, 64
        args.repeats, args.check = 2, True
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    rows = [
        row
        for batch in args.batch
        for context in args.context
        for budget in args.budget
        if (row := measure(args, batch, context, budget, device, dtype, gen)) is not None
    ]
    header = [
        "batch",
        "context",
        "budget",
        "avg kept",
        "max kept",
        "KV GiB",
        "dense ms",
        "ragged ms",
        "ragged GB/s",
        "ragged/dense",
        "tile",
        "dense SDPA",
    ]
    timing = "CUDA graph replays" if args.cuda_graph else "eager launches"
    emit_table(
        f"Ragged paged decode attention vs dense SDPA at equal KV bytes ({args.kv_heads} KV heads x "
        f"group {args.group}, D {args.head_size}, bs {args.block_size}, spread {args.spread}; {timing})",
        header,
        rows,
        device,
        args.markdown,
    )


if __name__ == "__main__":
    main()
