#!/usr/bin/env bash
# The GPU job of issue 33, for a GPU host without vLLM or network (Python 3.12, torch 2.11 cu130, triton 3.6,
# transformers 5.17): vLLM 0.32 from the bundle (benchmarks/gpu/build_bundle.py, built on the development
# machine and carried; docs/deploy.md), vanilla (TRITON_ATTN) against eviction (CUSTOM, ada-snapkv):
#   unpack       the bundle into $WORK_DIR, its wheels into $WORK_DIR/site (pip --target, no venv);
#   preflight    per server role: platform, imports, the engine config of every command line the stages
#                will run, the model on the meta device (seconds; a failure here costs no server start);
#   correctness weights  a seeded random checkpoint of the model's config ($WORK_DIR/random-model; weights never travel);
#   correctness  (a) greedy tokens identical to vanilla when the budget covers the prompt, (b) the evicted
#                run equal to the torch reference over the kept entries, (c) KV usage while decoding <= 0.35x
#                vanilla's at 25 % kept: one vanilla and one eviction server on that checkpoint;
#   bench        (d) `vllm bench serve`, random 4k prompts (2-6k), 128-384 output tokens, rate inf, vanilla vs
#                ada-snapkv 25 % and 10 %, one KV pool sized so vanilla is KV-bound, dummy weights;
#   graphs       (e) the same with piecewise CUDA graphs (optional: only with ONLY=graphs or GRAPHS=1);
#   prefix       issue 30's shared prefix: `vllm bench serve --dataset-name prefix_repetition`, one 3000-token
#                prefix, 400 tokens of each request's own, 64 output tokens, 32 requests, vanilla vs ada-snapkv
#                25 %, prefix-cache hits from the servers' counters (optional: only with ONLY=prefix or PREFIX=1);
#   scorer       the learned question-agnostic scorer (issue 53): (a)+(b) with kvzap on the random checkpoint
#                (its config's packaged scorer), and one `vllm bench serve` row of ada-kvzap at 25 %
#                (optional: only with ONLY=scorer or SCORER=1);
#   fp8          --kv-cache-dtype fp8 on both servers (issue 51): (a) greedy identity against fp8 vanilla and
#                (c) KV usage, and one `vllm bench serve` row of ada-snapkv 25 % against fp8 vanilla
#                (optional: only with ONLY=fp8 or FP8=1).
# Every stage has its own time limit and the job goes on after a failure (a stage that needs an earlier one's
# output fails fast); no stage starts past DEADLINE_S (default 540 s). Results: $OUT_DIR/<stage>.{json,md},
# logs under $OUT_DIR/logs, summary.md at the end with each stage's exit status and time; exit status 1 when any
# stage failed or was skipped for the deadline.
# Usage (repository root): OUT_DIR=$OUT bash benchmarks/gpu/run_gpu_job.sh
#   ONLY=REGEX    run only the stages whose name matches (unpack and preflight always run: the rest needs them)
#   DRY_RUN=1     on a CPU machine: unpack with the GPU host's tags, preflight with the CUDA platform mocked
#                 (imports, every stage's command lines parsed by vLLM, the model on meta); starts no server
#   BUNDLE_DIR (benchmarks/gpu/bundle), WORK_DIR (/tmp/kvevict-gpu), PYTHON (python3), DEADLINE_S
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PYTHON:-python3}
OUT=$(mkdir -p "${OUT_DIR:-benchmarks/results/gpu-job}" && cd "${OUT_DIR:-benchmarks/results/gpu-job}" && pwd)
BUNDLE=${BUNDLE_DIR:-benchmarks/gpu/bundle}
WORK=${WORK_DIR:-/tmp/kvevict-gpu}
DRY=${DRY_RUN:-0}
DEADLINE=${DEADLINE_S:-540}
mkdir -p "$OUT/logs"
SUMMARY=()
FAILED=0

stage() {  # stage NAME SECONDS command...: output to $OUT/logs/NAME.txt, status into the summary
  local name=$1 limit=$2 started=$SECONDS rc log
  shift 2
  log="$OUT/logs/${name}.txt"
  if [[ $name != unpack && $name != preflight* ]]; then
    if [[ $name == graphs && -z ${ONLY:-} && ${GRAPHS:-0} != 1 ]]; then return 0; fi
    if [[ $name == prefix && -z ${ONLY:-} && ${PREFIX:-0} != 1 ]]; then return 0; fi
    if [[ $name == scorer* && -z ${ONLY:-} && ${SCORER:-0} != 1 ]]; then return 0; fi
    if [[ $name == fp8* && -z ${ONLY:-} && ${FP8:-0} != 1 ]]; then return 0; fi
    [[ $name =~ ${ONLY:-.} ]] || return 0
  fi
  if ((limit > DEADLINE - SECONDS)); then limit=$((DEADLINE - SECONDS)); fi
  if ((limit < 10)); then
    SUMMARY+=("| $name | skipped: past the ${DEADLINE} s deadline | |"); FAILED=$((FAILED + 1)); return 1
  fi
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit} s)"
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  echo "=== $name: rc $rc in $((SECONDS - started)) s"
  tail -n 5 "$log"
  SUMMARY+=("| $name | rc $rc | $((SECONDS - started)) s |")
  ((rc == 0)) || FAILED=$((FAILED + 1))
  return $rc
}

{
  echo "date: $(date -u +%FT%TZ)  dry run: $DRY  bundle: $BUNDLE"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
  $PY -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" 2>&1
} | tee "$OUT/device.txt"

UNPACK_ARGS=()
PREFLIGHT_ARGS=()
if [[ $DRY == 1 ]]; then UNPACK_ARGS=(--foreign-python); PREFLIGHT_ARGS=(--mock-cuda); fi
rm -rf "$WORK"
stage unpack 120 bash -c "$PY benchmarks/gpu/unpack.py '$BUNDLE' '$WORK' ${UNPACK_ARGS[*]} > '$WORK.env'" \
  && cp "$WORK/missing_requirements.json" "$OUT/"
# shellcheck disable=SC1090
[[ -f $WORK.env ]] && source "$WORK.env"
export PYTHONPATH=${PYTHONPATH:-$REPO} PYTHONUNBUFFERED=1
unset VLLM_TARGET_DEVICE
MODEL=${KVEVICT_GPU_MODEL_DIR:-$WORK/model}
RANDOM_MODEL=$WORK/random-model
PREFIX_ARGS="--prefix-len 3000 --suffix-len 400 --output-len 64 --num-prompts 32"
SCORER_CHECK="--method kvzap --tag=-kvzap --checks greedy,reference"
SCORER_BENCH="--method ada-kvzap --budgets 0.25 --tag=-kvzap"
FP8_CHECK="--kv-cache-dtype fp8 --tag=-fp8 --checks greedy,kv_usage"
FP8_BENCH="--kv-cache-dtype fp8 --budgets 0.25 --tag=-fp8"

# Every stage's command lines, written without starting anything, then parsed by vLLM in the preflight.
# (correctness serves $RANDOM_MODEL, made later; its flags are checked on $MODEL, the same config)
stage "preflight commands" 60 bash -c "$PY -m benchmarks.gpu.correctness '$MODEL' '$OUT' --dry-run \
  && $PY -m benchmarks.gpu.bench_serve '$MODEL' '$OUT' --dry-run && $PY -m benchmarks.gpu.bench_serve '$MODEL' '$OUT' \
  --dry-run --graphs && $PY -m benchmarks.gpu.bench_serve '$MODEL' '$OUT' --dry-run $PREFIX_ARGS \
  && $PY -m benchmarks.gpu.correctness '$MODEL' '$OUT' --dry-run $SCORER_CHECK \
  && $PY -m benchmarks.gpu.bench_serve '$MODEL' '$OUT' --dry-run $SCORER_BENCH \
  && $PY -m benchmarks.gpu.correctness '$MODEL' '$OUT' --dry-run $FP8_CHECK \
  && $PY -m benchmarks.gpu.bench_serve '$MODEL' '$OUT' --dry-run $FP8_BENCH"
stage "preflight vanilla" 120 $PY -m benchmarks.gpu.preflight "$MODEL" --role vanilla "${PREFLIGHT_ARGS[@]}" \
  --json "$OUT/preflight-vanilla.json"
stage "preflight eviction" 120 $PY -m benchmarks.gpu.preflight "$MODEL" --role eviction "${PREFLIGHT_ARGS[@]}" \
  --json "$OUT/preflight-eviction.json" --commands "$OUT"/commands-*.json

if [[ $DRY != 1 ]]; then
  stage "correctness weights" 90 $PY -m benchmarks.gpu.random_weights "$MODEL" "$RANDOM_MODEL"
  stage correctness 240 $PY -m benchmarks.gpu.correctness "$RANDOM_MODEL" "$OUT"
  stage bench 300 $PY -m benchmarks.gpu.bench_serve "$MODEL" "$OUT"
  stage graphs 240 $PY -m benchmarks.gpu.bench_serve "$MODEL" "$OUT" --graphs
  # shellcheck disable=SC2086
  stage prefix 240 $PY -m benchmarks.gpu.bench_serve "$MODEL" "$OUT" $PREFIX_ARGS
  # shellcheck disable=SC2086
  stage scorer 150 $PY -m benchmarks.gpu.correctness "$RANDOM_MODEL" "$OUT" $SCORER_CHECK
  # shellcheck disable=SC2086
  stage "scorer bench" 200 $PY -m benchmarks.gpu.bench_serve "$MODEL" "$OUT" $SCORER_BENCH
  # shellcheck disable=SC2086
  stage fp8 150 $PY -m benchmarks.gpu.correctness "$RANDOM_MODEL" "$OUT" $FP8_CHECK
  # shellcheck disable=SC2086
  stage "fp8 bench" 200 $PY -m benchmarks.gpu.bench_serve "$MODEL" "$OUT" $FP8_BENCH
fi

{
  echo "# GPU job $(date -u +%FT%TZ) (dry run: $DRY)"
  echo
  echo "| stage | status | time |"
  echo "|---|---|---|"
  printf '%s\n' "${SUMMARY[@]}"
  for f in correctness bench bench-graphs bench-prefix correctness-kvzap bench-kvzap correctness-fp8 bench-fp8; do
    [[ -f $OUT/$f.md ]] && { echo; echo "## $f"; echo; cat "$OUT/$f.md"; }
  done
} > "$OUT/summary.md"
cat "$OUT/summary.md"
((FAILED == 0))  # the exit status: 0 when every stage that ran passed
