#!/usr/bin/env bash
# A GPU session's whole job for issue 15, standalone (torch + triton + nvcc + compute-sanitizer; no vLLM):
#   1. build the CUDA compaction op (torch JIT, timed);
#   2. the kernel tests on CUDA: every backend (CUDA op, Triton) against the torch reference,
#      fp32/fp16/bf16, block sizes 16/32/128, ragged per-head counts;
#   3. compute-sanitizer (memcheck, racecheck, initcheck) over the CUDA op's tests;
#   4. the kernel benchmarks, their tables appended to $OUT_DIR/kernels.md;
#   5. the eviction datapath's per-decode-step bookkeeping on the GPU under torch's sync debug mode.
# Every stage runs under its own time limit and the script goes on after a failure; the summary at the end
# names each stage's exit status (0 = passed). Results: at most 8 files in $OUT_DIR.
# Usage: benchmarks/kernels/run_gpu_tests.sh [--tests-only]     (PYTHON=... OUT_DIR=... to override;
#        ONLY=REGEX runs only the stages whose name matches, e.g. ONLY='parity|bookkeeping')
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvevict_torch_extensions}
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-benchmarks/results}
mkdir -p "$OUT"
SUMMARY=()

DEADLINE=${DEADLINE_S:-520}  # seconds from the start; no stage runs past it, so the summary is written
stage() {  # stage NAME SECONDS LOG command...: run with a time limit, output appended to LOG
  local name=$1 limit=$2 log=$3 started=$SECONDS rc
  shift 3
  if ((limit > DEADLINE - SECONDS)); then limit=$((DEADLINE - SECONDS)); fi
  if ((limit < 10)); then SUMMARY+=("$name: skipped, past the ${DEADLINE} s deadline"); return; fi
  [[ $name =~ ${ONLY:-.} ]] || return 0
  echo "=== $name ($(date -u +%H:%M:%S))" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "=== $name: rc $rc in $((SECONDS - started)) s" | tee -a "$log"
  SUMMARY+=("$name: rc $rc, $((SECONDS - started)) s")
}

SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  $PY -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
p = torch.cuda.get_device_properties(0); \
print(p.name, p.multi_processor_count, 'SMs', 'torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__)"
  nvcc --version | tail -2
  echo "compute-sanitizer: ${SANITIZER:-not found}"
} 2>&1 | tee "$OUT/device.txt"

stage "build the CUDA op" 240 "$OUT/kernel_tests.txt" $PY -c "import time; t = time.time(); \
from vllm_kvevict.layout.kernels import cuda_ext; cuda_ext.load_compaction_op(); \
print(f'built and loaded in {time.time() - t:.1f} s')"
# --confcutdir keeps pytest away from tests/conftest.py. parity_cases.py (not test_*) runs on its own: named
# beside its directory, pytest drops it as a duplicate of that directory.
stage "kernel parity on CUDA" 240 "$OUT/kernel_tests.txt" $PY -m pytest tests/kernels/parity_cases.py \
  --confcutdir=tests/kernels -p no:cacheprovider -q -rfEs -n 8
# The CPU-side kernel tests that need no Triton interpreter: the interpreted runs (test_dispatch's parity
# subprocess, test_benchmark_scripts) are CPU CI's, and this image's Triton 3.6 interpreter fails under its
# numpy 2.5 in Triton's own code (int() of a 1-element array in interpreter.py).
stage "kernel tests (compile, reference)" 180 "$OUT/kernel_tests.txt" $PY -m pytest \
  tests/kernels/test_reference_ops.py tests/kernels/test_cuda_compile.py tests/kernels/test_triton_compile.py \
  --confcutdir=tests/kernels -p no:cacheprovider -q -rfEs -n 4
if [ "${1:-}" = "--tests-only" ]; then printf '%s\n' "${SUMMARY[@]}"; exit 0; fi

# No caching allocator: every tensor is its own cudaMalloc, so memcheck sees each bound exactly.
sanitize() {
  stage "compute-sanitizer $1" 180 "$OUT/sanitizer.txt" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "${SANITIZER:-compute-sanitizer}" --tool "$1" --error-exitcode 9 $PY -m pytest \
    tests/kernels/parity_cases.py --confcutdir=tests/kernels -p no:cacheprovider -q -k "compaction and cuda"
}
sanitize memcheck

rm -f "$OUT/kernels.md"
# 32 layers x 8 KV heads x D 128: 32 requests of 16k tokens would be 64 GiB of cache, so the long prompts run
# with fewer requests
stage "compaction bench float16" 150 "$OUT/benchmarks.log" bash -c "$PY benchmarks/kernels/bench_compaction.py \
  --requests 1 8 32 --prompt 4096 --markdown $OUT/kernels.md && $PY benchmarks/kernels/bench_compaction.py \
  --requests 1 8 --prompt 16384 --markdown $OUT/kernels.md"
stage "compaction bench bfloat16" 90 "$OUT/benchmarks.log" $PY benchmarks/kernels/bench_compaction.py \
  --dtype bfloat16 --requests 8 --prompt 4096 --markdown "$OUT/kernels.md"
stage "ragged attention bench" 180 "$OUT/benchmarks.log" $PY benchmarks/kernels/bench_ragged_attention.py \
  --max-gib 8 --markdown "$OUT/kernels.md"
stage "ragged attention bench, CUDA graphs" 180 "$OUT/benchmarks.log" $PY \
  benchmarks/kernels/bench_ragged_attention.py --cuda-graph --max-gib 8 --markdown "$OUT/kernels.md"
stage "ragged attention tiles, CUDA graphs" 120 "$OUT/benchmarks.log" $PY \
  benchmarks/kernels/bench_ragged_attention.py --cuda-graph --batch 1 16 64 --context 32768 131072 \
  --budget 0.1 --tile default 32x4 64x4 128x4 128x8 --check --markdown "$OUT/kernels.md"
# the same shape over several draws of per-head lengths and sub-block order: how much the draw alone moves it
stage "ragged attention seeds, CUDA graphs" 120 "$OUT/benchmarks.log" bash -c "for seed in 1 2 3 4 5; do $PY \
  benchmarks/kernels/bench_ragged_attention.py --cuda-graph --batch 64 --context 16384 --budget 0.1 \
  --seed \$seed --markdown $OUT/kernels.md || exit 1; done"
# small batches miss the target: which key-range split count would serve them (choose_num_splits from data)
stage "ragged attention splits, CUDA graphs" 120 "$OUT/benchmarks.log" $PY \
  benchmarks/kernels/bench_ragged_attention.py --cuda-graph --batch 1 4 16 --context 4096 32768 131072 \
  --budget 0.1 0.25 --splits auto 1 2 4 8 16 32 --check --markdown "$OUT/kernels.md"
stage "scoring bench" 120 "$OUT/benchmarks.log" $PY benchmarks/kernels/bench_scoring.py --check \
  --markdown "$OUT/kernels.md"
stage "datapath bookkeeping (warn: lists every sync)" 150 "$OUT/host_overhead.txt" $PY \
  benchmarks/host_overhead.py --device cuda --sync-debug warn --batches 32,256 --block-sizes 16 \
  --methods snapkv,ada-snapkv --max-new 24 --seconds 2 --json "$OUT/host_overhead.json"
stage "datapath bookkeeping (error mode, batch 256)" 120 "$OUT/host_overhead.txt" $PY \
  benchmarks/host_overhead.py --device cuda --sync-debug error --batches 256 --block-sizes 16,32 \
  --methods snapkv,ada-snapkv --max-new 8 --seconds 1
# tile sweep on a few shapes, to retune vllm_kvevict/triton_kernels/paged_attention.py:tile_config from data
stage "ragged attention tiles" 120 "$OUT/benchmarks.log" $PY benchmarks/kernels/bench_ragged_attention.py \
  --batch 1 16 64 --context 32768 --budget 0.1 --tile default 32x4 64x4 64x8 128x8 --check \
  --markdown "$OUT/kernels.md"
stage "ragged attention bs 32/128" 120 "$OUT/benchmarks.log" bash -c "for bs in 32 128; do $PY \
  benchmarks/kernels/bench_ragged_attention.py --block-size \$bs --batch 16 64 --context 32768 131072 \
  --budget 0.1 0.25 --max-gib 8 --markdown $OUT/kernels.md || exit 1; done"
sanitize racecheck
sanitize initcheck
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
echo "tables in $OUT/kernels.md: copy them into docs/benchmarks.md with the GPU named"
