"""Compile every Triton kernel for real NVIDIA targets without a GPU (Triton's own LLVM + bundled ptxas).

The interpreter checks what the kernels compute; this checks that they compile to cubin for sm_80/sm_90
(int-to-pointer casts, reshapes, early returns, dot shapes and shared memory are what the interpreter never
sees) and, with ``ptxas -v``, that they do not spill registers in the launch configurations the launchers
use. Run as a script, TRITON_INTERPRET unset:  python tests/kernels/triton_aot.py [--quick] [--arch 90 80]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

from vllm_kvevict.triton_kernels import compaction, paged_attention, window_scores  # noqa: E402

ELEMENT_SIZE = {"fp16": 2, "bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class KernelCase:
    label: str
    kernel: object
    pointers: dict  # pointer argument -> element type ("fp16", "i32", ...)
    constexprs: dict
    num_warps: int = 4
    # fp32 caches exist only in tests (exact comparisons); their spills are reported, not failed
    spills_fail: bool = True
    # PTX instructions the case must contain, e.g. 16-byte global accesses
    expect_ptx: tuple[str, ...] = ()

    def signature(self) -> dict:
        """Argument types: pointers as given, ``scale`` fp32, the remaining scalars i32."""
        types = {}
        for name in self.kernel.arg_names:
            if name in self.constexprs:
                types[name] = "constexpr"
            elif name in self.pointers:
                types[name] = "*" + self.pointers[name]
            else:
                types[name] = "fp32" if name == "scale" else "i32"
        return types

    def divisibility(self) -> dict:
        """What a JIT launch tells the compiler: torch's pointers and the strides (multiples of D or of the
        key tile) are divisible by 16; table strides and counts in general are not."""
        never = {"stride_table", "stride_ps"}
        aligned = [
            i
            for i, name in enumerate(self.kernel.arg_names)
            if name not in self.constexprs
            and name not in never
            and (name in self.pointers or "stride" in name or name == "split_len")
        ]
        return {(i,): [["tt.divisibility", 16]] for i in aligned}


def cases() -> list[KernelCase]:
    """The configurations the launchers produce (D = 128, block_size 16)."""
    out = []
    for dt in ("fp16", "bf16", "fp32"):
        for gather in (True, False):
            out.append(
                KernelCase(
                    f"compaction {dt} gather={gather}",
                    compaction._move_rows_kernel,
                    dict(
                        cache_ptr=dt, layer_offsets_ptr="i64", slots_ptr="i64", layer_ptr="i64", buffer_ptr=dt
                    ),
                    dict(
                        BLOCK_SIZE=16,
                        HEAD_SIZE=128,
                        BLOCK_D=128,
                        BLOCK_M=16,
                        VECTOR=16 // ELEMENT_SIZE[dt],
                        GATHER=gather,
                    ),
                    expect_ptx=("ld.global.v4.b32", "st.global.v4.b32"),
                )
            )
    for dt in ("fp16", "bf16", "fp32"):
        block_n, num_warps = paged_attention.tile_config(ELEMENT_SIZE[dt])
        for shape, block_q, g_pad in (("decode g4", 4, 4), ("prefill g4", 16, 4), ("decode g1", 16, 1)):
            for partial in (False, True):
                out.append(
                    KernelCase(
                        f"ragged attention {dt} {shape} partial={partial}",
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
                            BLOCK_N=block_n,
                            CAUSAL=shape.startswith("prefill"),
                            PARTIAL=partial,
                            DOT_PRECISION="ieee" if dt == "fp32" else "tf32",
                        ),
                        num_warps,
                        spills_fail=dt != "fp32",
                        # K/V tiles gathered through the tables still arrive as 16-byte async copies
                        expect_ptx=("cp.async.cg.shared.global",) if dt != "fp32" else (),
                    )
                )
    out.append(
        KernelCase(
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
                scores_ptr="fp32",
            )
            for label, scores in (("stats", False), ("scores", True)):
                out.append(
                    KernelCase(
                        f"window {label} {dt} g{g_pad} w{w_pad}",
                        window_scores._window_pass_kernel,
                        ptrs,
                        dict(common, SCORES=scores),
                    )
                )
    for kind in ("max", "avg"):
        out.append(
            KernelCase(
                f"pool + group mean {kind}",
                window_scores._pool_group_mean_kernel,
                dict(scores_ptr="fp32", seq_lens_ptr="i32", pooled_lens_ptr="i32", out_ptr="fp32"),
                dict(KERNEL=7, IS_MAX=kind == "max", BLOCK_N=128),
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
    "pool + group mean max",
)


def ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill bytes) of a kernel's PTX, from ``ptxas -v`` (Triton's bundled ptxas)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        suffix = "a" if arch >= 90 else ""
        result = subprocess.run(
            [
                get_ptxas(arch).path,
                f"-arch=sm_{arch}{suffix}",
                "-v",
                str(source),
                "-o",
                str(Path(tmp) / "k.o"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    registers = int(re.search(r"Used (\d+) registers", result.stderr).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", result.stderr))
    return registers, spills


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--quick", action="store_true", help="only the cases named in QUICK (CI time budget)")
    args = parser.parse_args()
    selected = [c for c in cases() if not args.quick or c.label in QUICK]
    failures = []
    for arch in args.arch:
        for case in selected:
            t0 = time.perf_counter()
            compiled = compile(
                ASTSource(case.kernel, case.signature(), case.constexprs, case.divisibility()),
                target=GPUTarget("cuda", arch, 32),
                options=dict(num_warps=case.num_warps),
            )
            assert len(compiled.asm["cubin"]) > 0, case.label
            missing = [op for op in case.expect_ptx if op not in compiled.asm["ptx"]]
            if missing:
                failures.append(f"sm_{arch} {case.label} lacks {missing}")
            registers, spills = ptxas_report(compiled.asm["ptx"], arch)
            status = "OK" if spills == 0 else "SPILL" if case.spills_fail else "SPILL (fp32, tests only)"
            if spills and case.spills_fail:
                failures.append(f"sm_{arch} {case.label}")
            print(
                f"{status} sm_{arch} {case.label}: {case.num_warps} warps, {registers} registers, "
                f"{spills} B spilled, "
                f"shared {compiled.metadata.shared} B, {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
    if failures:
        print("register spills in: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
