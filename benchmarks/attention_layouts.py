"""vLLM's CPU attention kernel on the same batch in its own layout and head-as-sequence (the eviction layout).

The evicting backend runs ``cpu_attention_with_kv_cache`` with every (request, KV head) as a sequence of one
KV head and ``group`` query heads over sub-blocks ``b * H + h`` of the same cache (``backend_cpu.py``). This
times both forms on identical batches — the same query rows, context lengths and (scattered) blocks, so the
same work — on ``--threads`` threads (the served worker's default binding gives it one core), and prints
milliseconds per call and their ratio. Shapes default to the bundled model (3 KV heads, 9 query heads, head
size 64, bf16, blocks of 32).

    .venv/bin/python -m benchmarks.attention_layouts
"""

from __future__ import annotations

import argparse
import time

import torch

#: (label, [(query rows, context length) per request]) of the batches compared.
BATCHES = (
    ("16 decodes, context 3,450", [(1, 3450)] * 16),
    ("12 decodes + one 400-row prefill over 3,400", [(1, 3450)] * 12 + [(400, 3400)]),
    ("4 prefills of 400 rows over 3,400", [(400, 3400)] * 4),
    ("one 3,400-row prefill", [(3400, 3400)]),
)


def timed_ms(call, repeats: int, flush: torch.Tensor | None = None) -> float:
    """Median milliseconds of ``repeats`` calls after one warm-up; with ``flush`` (a buffer larger than the
    CPU's caches), it is rewritten before each call, so that the call starts from cold caches as a layer's
    attention does in a server after the rest of the model ran."""
    call()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.add_(1)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def attention_call(batch: list[tuple[int, int]], per_head: bool, kv: torch.Tensor, args: argparse.Namespace):
    """A ready ``cpu_attention_with_kv_cache`` call on ``batch`` in one of the two forms."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    num_blocks, heads, block_size, _ = kv.shape
    group, dim = args.query_heads // heads, args.head_size
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    shared = blocks[: args.shared_prefix // block_size]  # the same leading blocks in every request
    rows, query_lens, lengths, used = [], [], [], shared.numel()
    for query_len, length in batch:
        count = -(-length // block_size) - shared.numel()
        own = torch.cat([shared, blocks[used : used + count]])
        used += count
        for h, table in enumerate([own * heads + h for h in range(heads)] if per_head else [own]):
            rows.append((h if args.head_major else 0, len(rows), table))
            query_lens.append(query_len)
            lengths.append(length)
    order = sorted(range(len(rows)), key=lambda i: rows[i][:2])  # head-major: every request's head 0 first
    rows = [rows[i][2] for i in order]
    query_lens, lengths = [query_lens[i] for i in order], [lengths[i] for i in order]
    block_table = torch.zeros(len(rows), max(r.numel() for r in rows), dtype=torch.int32)
    for i, table in enumerate(rows):
        block_table[i, : table.numel()] = table
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    if per_head:
        view, query_heads, kv_heads = kv.view(num_blocks * heads, 1, 2 * block_size, dim), group, 1
    else:
        view, query_heads, kv_heads = kv.view(num_blocks, heads, 2 * block_size, dim), args.query_heads, heads
    key_cache, value_cache = view.chunk(2, dim=2)
    query = torch.randn(int(starts[-1]), query_heads, dim, dtype=kv.dtype)
    out = torch.empty_like(query)
    isa = _get_attn_isa(kv.dtype, block_size, dim)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(rows), num_heads=query_heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=seq_lens,
        dtype=kv.dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=args.kv_split, kv_cache_dtype="auto",
    )
    return lambda: ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
        seq_lens=seq_lens, scale=dim**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=block_table, softcap=0.0, scheduler_metadata=metadata, s_aux=None, k_scale=1.0,
        v_scale=1.0, kv_cache_dtype="auto",
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--query-heads", type=int, default=9)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=4000, help="cache blocks the batches draw from")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens (whole blocks) at the start of every request read from the same blocks, as requests "
        "that found one prefix in vLLM's prefix cache",
    )
    parser.add_argument(
        "--cold", type=int, default=0, metavar="MIB", help="rewrite MIB MiB before each call (0: warm caches)"
    )
    parser.add_argument(
        "--head-major",
        action="store_true",
        help="head-as-sequence rows ordered by KV head, then request (default: request, then head)",
    )
    parser.add_argument(
        "--kv-split",
        type=int,
        default=1,
        choices=(0, 1),
        help="the kernel's enable_kv_split (vLLM's VLLM_CPU_ATTN_SPLIT_KV, on by default in the server)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if torch.cpu._is_amx_tile_supported():  # vLLM picks its "amx" ISA: the process needs AMX permission
        torch._C._cpu._init_amx()
    dtype = getattr(torch, args.dtype)
    kv = torch.randn(args.num_blocks, args.kv_heads, args.block_size, 2 * args.head_size, dtype=dtype)
    print(f"{args.dtype}, {args.kv_heads} KV heads x {args.query_heads // args.kv_heads} query heads, "
          f"head size {args.head_size}, blocks of {args.block_size}, {args.threads} thread(s), "
          f"kv split {'on' if args.kv_split else 'off'}, shared prefix {args.shared_prefix} tokens, "
          f"{'head' if args.head_major else 'request'}-major head sequences, "
          f"{f'caches flushed ({args.cold} MiB)' if args.cold else 'warm caches'}")
    flush = torch.zeros(args.cold * 2**18) if args.cold else None  # float32: 2**18 per MiB
    print("| batch | vLLM's layout ms | head-as-sequence ms | ratio |")
    print("|---|---:|---:|---:|")
    for label, batch in BATCHES:
        standard = timed_ms(attention_call(batch, False, kv, args), args.repeats, flush)
        per_head = timed_ms(attention_call(batch, True, kv, args), args.repeats, flush)
        print(f"| {label} | {standard:.2f} | {per_head:.2f} | {per_head / standard:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
