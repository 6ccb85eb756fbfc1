"""Compile every Triton kernel for real NVIDIA targets without a GPU (Triton's own LLVM + bundled ptxas).

The interpreter checks what the kernels compute; this checks that they compile to cubin for sm_80/sm_90
(int-to-pointer casts, reshapes, early returns, dot shapes and shared memory are what the interpreter never
sees). Run as a script, with TRITON_INTERPRET unset:  python tests/kernels/triton_aot.py [--arch 90 80]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

from triton_kernels import compaction, paged_attention, scoring  # noqa: E402

DTYPES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}


def signature(kernel, pointers: dict[str, str], constexprs: dict[str, object], floats=("scale",)) -> dict:
    """Argument types: pointers as given, ``floats`` fp32, the remaining scalars i32."""
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in pointers:
            types[name] = "*" + pointers[name]
        else:
            types[name] = "fp32" if name in floats else "i32"
    return types


def cases() -> list[tuple[str, object, dict, dict]]:
    """(label, kernel, pointer types, constexprs) for the configurations the launchers produce."""
    out = []
    for dt in ("fp16", "bf16", "fp32"):
        for gather in (True, False):
            out.append(
                (
                    f"compaction {dt} gather={gather}",
                    compaction._move_rows_kernel,
                    dict(cache_ptrs="i64", slots_ptr="i64", layer_ptr="i64", buffer_ptr=dt),
                    dict(BLOCK_SIZE=16, HEAD_SIZE=128, BLOCK_D=128, BLOCK_M=16, GATHER=gather),
                )
            )
    attention_shapes = [("decode g4", 4, 4), ("prefill g4", 16, 4), ("decode g1", 16, 1)]
    for dt in ("fp16", "bf16", "fp32"):
        for label, block_q, g_pad in attention_shapes:
            for partial in (False, True):
                if dt == "fp32" and partial:
                    continue
                out.append(
                    (
                        f"ragged attention {dt} {label} partial={partial}",
                        paged_attention._ragged_attention_kernel,
                        dict(
                            q_ptr=dt,
                            k_ptr=dt,
                            v_ptr=dt,
                            tables_ptr="i32",
                            seq_lens_ptr="i32",
                            query_start_ptr="i32",
                            out_ptr="fp32" if partial else dt,
                            lse_ptr="fp32" if partial else dt,
                        ),
                        dict(
                            BLOCK_SIZE=16,
                            HEAD_SIZE=128,
                            BLOCK_D=128,
                            BLOCK_Q=block_q,
                            G_PAD=g_pad,
                            BLOCK_N=32 if dt == "fp32" else 64,  # as the launcher picks
                            CAUSAL=label.startswith("prefill"),
                            PARTIAL=partial,
                            DOT_PRECISION="ieee" if dt == "fp32" else "tf32",
                        ),
                    )
                )
    out.append(
        (
            "merge splits fp16",
            paged_attention._merge_splits_kernel,
            dict(part_ptr="fp32", lse_ptr="fp32", out_ptr="fp16"),
            dict(HEAD_SIZE=128, BLOCK_D=128, BLOCK_R=16),
        )
    )
    for dt in ("fp16", "bf16"):
        for g_pad, w_pad in ((4, 32), (1, 32)):
            common = dict(
                BLOCK_SIZE=16,
                HEAD_SIZE=128,
                BLOCK_D=128,
                G_PAD=g_pad,
                W_PAD=w_pad,
                BLOCK_N=64,
                DOT_PRECISION="tf32",
            )
            ptrs = dict(
                q_ptr=dt,
                positions_ptr="i32",
                k_ptr=dt,
                tables_ptr="i32",
                seq_lens_ptr="i32",
                max_ptr="fp32",
                sum_ptr="fp32",
            )
            out.append((f"window stats {dt} g{g_pad} w{w_pad}", scoring._window_stats_kernel, ptrs, common))
            out.append(
                (
                    f"window scores {dt} g{g_pad} w{w_pad}",
                    scoring._window_scores_kernel,
                    dict(ptrs, scores_ptr="fp32"),
                    common,
                )
            )
    return out


# one of each kernel and launch shape, fp16 (and bf16 attention): what make test can afford on 2 cores
QUICK = (
    "compaction fp16 gather=True",
    "compaction fp16 gather=False",
    "ragged attention fp16 decode g4 partial=False",
    "ragged attention fp16 prefill g4 partial=True",
    "ragged attention bf16 decode g1 partial=False",
    "merge splits fp16",
    "window stats fp16 g4 w32",
    "window scores fp16 g4 w32",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--quick", action="store_true", help="only the cases named in QUICK (CI time budget)")
    args = parser.parse_args()
    selected = [c for c in cases() if not args.quick or c[0] in QUICK]
    for arch in args.arch:
        for label, kernel, pointers, constexprs in selected:
            t0 = time.perf_counter()
            compiled = compile(
                ASTSource(kernel, signature(kernel, pointers, constexprs), constexprs),
                target=GPUTarget("cuda", arch, 32),
            )
            assert len(compiled.asm["cubin"]) > 0, label
            print(
                f"OK sm_{arch} {label}: shared {compiled.metadata.shared} B, "
                f"{time.perf_counter() - t0:.1f} s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
