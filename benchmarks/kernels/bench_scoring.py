"""Observation-window scoring time vs the prefill attention time of the same layer.

Per layer and prompt length n (batch 1): prefill attention is causal SDPA over [1, q_heads, n, D] with GQA;
scoring is ``paged_window_scores`` (window queries over the layer's keys read from the uncompacted paged
cache, max-pooled, GQA mean) with the Triton kernels, and for reference the policy library's chunked torch
``window_attention`` on contiguous keys. "triton/prefill" is the share of prefill time eviction adds.
Target (issue 6): <= 0.05.

    python benchmarks/kernels/bench_scoring.py            # GPU
    python benchmarks/kernels/bench_scoring.py --smoke    # CPU check that it runs
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bench_common import base_parser, emit_table, time_ms

from vllm_kvevict.layout.kernels import reference, subblock_tables_from_block_tables
from vllm_kvevict.policies.attention_scores import window_attention
from vllm_kvevict.triton_kernels.window_scores import paged_window_scores


def measure(args, n: int, device, dtype) -> list[object]:
    heads, group, d, bs, w = args.kv_heads, args.group, args.head_size, args.block_size, args.window
    blocks = -(-n // bs)
    # one request's prompt in its own blocks, in vLLM's order: sub-block of (block b, head h) = b * H + h
    k_cache = torch.randn(blocks * heads, bs, d, dtype=dtype, device=device)
    block_table = torch.randperm(blocks, dtype=torch.int32)[None].to(device)
    tables = subblock_tables_from_block_tables(block_table, heads)
    seq_lens = torch.full((heads,), n, dtype=torch.int32, device=device)
    queries = torch.randn(heads, group, w, d, dtype=dtype, device=device)
    num_pooled = seq_lens - w

    def triton_scores():
        return paged_window_scores(queries, k_cache, tables, seq_lens, num_pooled=num_pooled, pool_kernel=7)

    if args.check:
        want = reference.paged_window_scores(queries, k_cache, tables, seq_lens, num_pooled=num_pooled)
        torch.testing.assert_close(triton_scores(), want, atol=1e-4, rtol=1e-2)
    triton_ms = time_ms(triton_scores, device, repeats=args.repeats)
    dense_keys = torch.randn(heads, n, d, dtype=dtype, device=device)
    q_heads = queries.reshape(heads * group, w, d)
    torch_ms = time_ms(lambda: window_attention(q_heads, dense_keys), device, repeats=args.repeats)
    q = torch.randn(1, heads * group, n, d, dtype=dtype, device=device)
    k = dense_keys[None]
    v = torch.randn_like(k)
    prefill_ms = time_ms(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        device,
        repeats=args.repeats,
    )
    return [n, prefill_ms, triton_ms, torch_ms, triton_ms / prefill_ms, torch_ms / prefill_ms]


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, nargs="+", default=[4096, 16384, 32768, 131072])
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--check", action="store_true", help="compare with the torch reference first")
    args = parser.parse_args()
    if args.smoke:
        args.prompt, args.kv_heads, args.head_size, args.window, args.repeats, args.check = (
            [256],
            2,
            64,
            8,
            2,
            True,
        )
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = [measure(args, n, device, dtype) for n in args.prompt]
    header = ["prompt", "prefill ms", "triton ms", "torch ms", "triton/prefill", "torch/prefill"]
    emit_table(
        f"Window scoring vs prefill attention per layer ({args.kv_heads} KV heads x group {args.group}, "
        f"D {args.head_size}, window {args.window})",
        header,
        rows,
        device,
        args.markdown,
    )


if __name__ == "__main__":
    main()
