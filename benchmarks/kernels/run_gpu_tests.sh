#!/usr/bin/env bash
# The GPU session's whole job for issue 6, standalone (torch + triton, nvcc for the CUDA op; no vLLM):
#   1. the kernel tests on CUDA: every backend (CUDA op, Triton) against the torch reference, fp32/fp16/bf16;
#   2. the three benchmarks, their tables appended to $OUT_DIR/kernels.md.
# Usage: benchmarks/kernels/run_gpu_tests.sh [--tests-only]     (PYTHON=... OUT_DIR=... to override)
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
OUT=${OUT_DIR:-benchmarks/results}
mkdir -p "$OUT"
$PY -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  | tee "$OUT/device.txt"
# --confcutdir keeps pytest away from tests/conftest.py; parity_cases.py is named explicitly (not test_*)
$PY -m pytest tests/kernels tests/kernels/parity_cases.py --confcutdir=tests/kernels -p no:cacheprovider -q -rfEs \
  2>&1 | tee "$OUT/kernel_tests.txt"
[ "${1:-}" = "--tests-only" ] && exit 0
rm -f "$OUT/kernels.md"
$PY benchmarks/kernels/bench_compaction.py --markdown "$OUT/kernels.md"
$PY benchmarks/kernels/bench_ragged_attention.py --markdown "$OUT/kernels.md"
# tile sweep on a few shapes, to retune vllm_kvevict/triton_kernels/paged_attention.py:tile_config from data
$PY benchmarks/kernels/bench_ragged_attention.py --batch 1 16 64 --context 32768 --budget 0.1 \
  --tile default 32x4 64x4 64x8 128x8 --check --markdown "$OUT/kernels.md"
$PY benchmarks/kernels/bench_scoring.py --markdown "$OUT/kernels.md"
echo "tables in $OUT/kernels.md: copy them into docs/benchmarks.md with the GPU named"
