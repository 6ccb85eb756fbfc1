"""The learned scorer's cost per layer beside the observation window's and the prefill attention's.

Per layer of the bundled model's shapes (3 KV heads x group 3, D 64) and n held entries: ``learned`` is
``SurrogateScorer.layer_scores`` of a shipped scorer (features from each entry's key and value, the
standardisation, one matmul, and for the MLP a GELU and a second matmul) - what ``kvzap``/``ada-kvzap`` pay
per layer when they evict a prompt of n tokens or re-score n held entries while decoding; ``window`` is
SnapKV's scoring (the last 32 queries over the n keys, the policy library's torch ``window_attention``); and
``prefill`` the causal attention of the n-token prompt (SDPA, GQA). Times are medians; "us/token" divides
by n (a prompt's tokens, or a decode re-score's held entries).

    python benchmarks/kernels/bench_learned_scorer.py --markdown
    python benchmarks/kernels/bench_learned_scorer.py --smoke
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bench_common import base_parser, emit_table, time_ms

from vllm_kvevict.policies.attention_scores import window_attention
from vllm_kvevict.policies.served_scorer import load_scorer
from vllm_kvevict.policies.surrogate_scorer import PACKAGED_SCORERS, SurrogateScorer


def measure(args, scorers: dict[str, SurrogateScorer], n: int, device, dtype) -> list[object]:
    spec = next(iter(scorers.values())).spec
    heads, d, group, w = spec.num_kv_heads, spec.head_dim, args.group, args.window
    keys = torch.randn(heads, n, d, dtype=dtype, device=device)
    values = torch.randn(heads, n, d, dtype=dtype, device=device)
    layer = args.layer
    row: list[object] = [n]
    learned = []
    for scorer in scorers.values():
        ms = time_ms(lambda s=scorer: s.layer_scores(layer, keys, values), device, repeats=args.repeats)
        learned.append(ms)
        row += [ms, 1000 * ms / n]
    queries = torch.randn(heads * group, w, d, dtype=dtype, device=device)
    window_ms = time_ms(lambda: window_attention(queries, keys), device, repeats=args.repeats)
    q = torch.randn(1, heads * group, n, d, dtype=dtype, device=device)
    prefill_ms = time_ms(
        lambda: F.scaled_dot_product_attention(q, keys[None], values[None], is_causal=True, enable_gqa=True),
        device,
        repeats=args.repeats,
    )
    row += [window_ms, 1000 * window_ms / n, prefill_ms]
    row += [ms / window_ms for ms in learned] + [ms / prefill_ms for ms in learned]
    return row


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head (SmolLM2: 3)")
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.prompt, args.repeats = [256], 2
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    scorers = {
        path.name.rsplit("-", 1)[-1]: load_scorer(str(path), str(device))
        for path in sorted(PACKAGED_SCORERS.iterdir())
        if (path / "scorer.json").is_file()
    }
    rows = [measure(args, scorers, n, device, dtype) for n in args.prompt]
    names = list(scorers)
    header = ["entries n"]
    for name in names:
        header += [f"{name} ms", f"{name} us/token"]
    header += ["window ms", "window us/token", "prefill attn ms"]
    header += [f"{name}/window" for name in names] + [f"{name}/prefill attn" for name in names]
    emit_table(
        f"Learned scorer vs window scoring vs prefill attention, one layer (layer {args.layer}, "
        f"{next(iter(scorers.values())).spec.num_kv_heads} KV heads x group {args.group})",
        header,
        rows,
        device,
        args.markdown,
    )


if __name__ == "__main__":
    main()
