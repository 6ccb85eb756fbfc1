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
#   shape configs  config.json of each model shape (benchmarks/gpu/shapes.py: SmolLM2-135M, Qwen2.5-1.5B,
#                Llama-3.1-8B) with the bundled tokenizer as a stand-in, into $WORK_DIR/shapes (weights dummy);
#   bench <shapes> (d) `vllm bench serve` per shape (benchmarks/gpu/bench_shapes.py; SmolLM2 and Qwen in one stage,
#                their four servers started together, Llama alone): 8k and 16k random prompts,
#                256 output tokens, rate inf, vanilla vs ada-snapkv 25 % and 10 % and the kept-context default
#                (ada-kvzap where a scorer ships: SmolLM2 only; elsewhere its HTTP 400 recorded), one KV pool
#                sized from the shape so vanilla holds 8 requests of 8k, dummy weights;
#   graphs       (e) the same with piecewise CUDA graphs (optional: only with ONLY=graphs or GRAPHS=1);
#   prefix       issue 30's shared prefix: `vllm bench serve --dataset-name prefix_repetition`, one 3000-token
#                prefix, 400 tokens of each request's own, 64 output tokens, 32 requests, vanilla vs ada-snapkv
#                25 %, prefix-cache hits from the servers' counters (optional: only with ONLY=prefix or PREFIX=1);
#   scorer       the learned question-agnostic scorer (issue 53): (a)+(b) with kvzap on the random checkpoint
#                (its config's packaged scorer; its bench row is bench smollm2-135m's ada-kvzap row)
#                (optional: only with ONLY=scorer or SCORER=1);
#   fp8          --kv-cache-dtype fp8 on both servers (issue 51): (a) greedy identity against fp8 vanilla and
#                (c) KV usage, and one `vllm bench serve` row of ada-snapkv 25 % against fp8 vanilla
#                (optional: only with ONLY=fp8 or FP8=1).
# Every stage has its own time limit and the job goes on after a failure (a stage that needs an earlier one's
# output fails fast); no stage starts past DEADLINE_S (default 540 s). Results: $OUT_DIR/<stage>.{json,md},
# logs under $OUT_DIR/logs, summary.md at the end with each stage's exit status and time; exit status 1 when any
# stage failed or was skipped for the deadline.
# Usage (repository root): CALL=N OUT_DIR=$OUT bash benchmarks/gpu/run_gpu_job.sh
#   CALL=N        one device call of the plan (benchmarks/gpu/job_plan.py: 1 preflight, correctness, bench
#                 smollm2-135m; 2 the Qwen and Llama shapes; 3 scorer, fp8, prefix), its stages and deadline;
#                 the default without ONLY is CALL=1. Stage limits come from job_plan.py either way.
#   ONLY=REGEX    run only the stages whose name matches (unpack and shape configs always run; preflight too,
#                 except in a CALL that does not list it)
#   DRY_RUN=1     on a CPU machine: unpack with the GPU host's tags, preflight with the CUDA platform mocked
#                 (imports, every stage's command lines parsed by vLLM, the model on meta); starts no server
#   BUNDLE_DIR (benchmarks/gpu/bundle), WORK_DIR (/tmp/kvevict-gpu; a later call on the same machine reuses it
#                 when it was unpacked from the same bundle), PYTHON (python3), DEADLINE_S
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PYTHON:-python3}
OUT=$(mkdir -p "${OUT_DIR:-benchmarks/results/gpu-job}" && cd "${OUT_DIR:-benchmarks/results/gpu-job}" && pwd)
BUNDLE=${BUNDLE_DIR:-benchmarks/gpu/bundle}
WORK=${WORK_DIR:-/tmp/kvevict-gpu}
DRY=${DRY_RUN:-0}
if [[ -z ${CALL:-} && -z ${ONLY:-} ]]; then CALL=1; fi
# LIMIT[stage]; with CALL, its ONLY and DEADLINE_S
eval "$($PY -m benchmarks.gpu.job_plan shell ${CALL:+--call "$CALL"})" || exit 1
DEADLINE=${DEADLINE_S:-540}
mkdir -p "$OUT/logs"
SUMMARY=()
FAILED=0

stage() {  # stage NAME command...: output to $OUT/logs/NAME.txt, status into the summary; limit LIMIT[NAME]
  local name=$1 limit=${LIMIT[$1]} started=$SECONDS rc log
  shift 1
  log="$OUT/logs/${name}.txt"
  if [[ $name == preflight* && -n ${CALL:-} && $DRY != 1 ]]; then
    [[ $name =~ $ONLY ]] || return 0
  elif [[ $name != unpack && $name != "shape configs" && $name != preflight* ]]; then
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
if [[ -f $WORK.env ]] && cmp -s "$BUNDLE/manifest.json" "$WORK/bundle-manifest.json"; then
  SUMMARY+=("| unpack | reused $WORK (same bundle) | 0 s |"); cp "$WORK/missing_requirements.json" "$OUT/"
else
  rm -rf "$WORK" "$WORK.env"
  stage unpack bash -c "$PY benchmarks/gpu/unpack.py '$BUNDLE' '$WORK' ${UNPACK_ARGS[*]} > '$WORK.env'" \
    && cp "$WORK/missing_requirements.json" "$OUT/" && cp "$BUNDLE/manifest.json" "$WORK/bundle-manifest.json"
fi
# shellcheck disable=SC1090
[[ -f $WORK.env ]] && source "$WORK.env"
export PYTHONPATH=${PYTHONPATH:-$REPO} PYTHONUNBUFFERED=1
unset VLLM_TARGET_DEVICE
MODEL=${KVEVICT_GPU_MODEL_DIR:-$WORK/model}
RANDOM_MODEL=$WORK/random-model
SHAPES=$WORK/shapes
SHAPE_NAMES=()
for group in "${BENCH_GROUPS[@]}"; do read -r -a names <<<"$group"; SHAPE_NAMES+=("${names[@]}"); done
PREFIX_ARGS="--prefix-len 3000 --suffix-len 400 --output-len 64 --num-prompts 32"
SCORER_CHECK="--method kvzap --tag=-kvzap --checks greedy,reference"
FP8_CHECK="--kv-cache-dtype fp8 --tag=-fp8 --checks greedy,kv_usage"
FP8_BENCH="--kv-cache-dtype fp8 --budgets 0.25 --tag=-fp8"

stage "shape configs" $PY -m benchmarks.gpu.shapes write "$MODEL" "$SHAPES"

# Every stage's command lines, written without starting anything, then parsed by vLLM in the preflight.
# (correctness serves $RANDOM_MODEL, made later; its flags are checked on $MODEL, the same config)
SHAPE_DRY_RUNS=""
for group in "${BENCH_GROUPS[@]}"; do  # per group, so that its memory check runs too
  read -r -a names <<<"$group"
  SHAPE_DRY_RUNS+=" && $PY -m benchmarks.gpu.bench_shapes ${names[*]/#/$SHAPES/} '$OUT' --dry-run"
done
stage "preflight commands" bash -c "$PY -m benchmarks.gpu.correctness '$MODEL' '$OUT' --dry-run \
  && $PY -m benchmarks.gpu.bench_serve '$MODEL' '$OUT' --dry-run --graphs \
  && $PY -m benchmarks.gpu.bench_serve '$MODEL' '$OUT' --dry-run $PREFIX_ARGS \
  && $PY -m benchmarks.gpu.correctness '$MODEL' '$OUT' --dry-run $SCORER_CHECK \
  && $PY -m benchmarks.gpu.correctness '$MODEL' '$OUT' --dry-run $FP8_CHECK \
  && $PY -m benchmarks.gpu.bench_serve '$MODEL' '$OUT' --dry-run $FP8_BENCH $SHAPE_DRY_RUNS"
stage "preflight vanilla" $PY -m benchmarks.gpu.preflight "$MODEL" --role vanilla "${PREFLIGHT_ARGS[@]}" \
  --json "$OUT/preflight-vanilla.json"
stage "preflight eviction" $PY -m benchmarks.gpu.preflight "$MODEL" --role eviction "${PREFLIGHT_ARGS[@]}" \
  --json "$OUT/preflight-eviction.json" --commands "$OUT"/commands-*.json --shapes "${SHAPE_NAMES[@]/#/$SHAPES/}"

if [[ $DRY != 1 ]]; then
  if [[ -f $RANDOM_MODEL/model.safetensors && "correctness weights" =~ ${ONLY:-.} ]]; then
    SUMMARY+=("| correctness weights | reused $RANDOM_MODEL | 0 s |")
  else
    stage "correctness weights" $PY -m benchmarks.gpu.random_weights "$MODEL" "$RANDOM_MODEL"
  fi
  stage correctness $PY -m benchmarks.gpu.correctness "$RANDOM_MODEL" "$OUT"
  for group in "${BENCH_GROUPS[@]}"; do  # one stage per group: its shapes' servers start together
    read -r -a names <<<"$group"
    stage "bench ${group// /+}" $PY -m benchmarks.gpu.bench_shapes "${names[@]/#/$SHAPES/}" "$OUT"
  done
  stage graphs $PY -m benchmarks.gpu.bench_serve "$MODEL" "$OUT" --graphs
  # shellcheck disable=SC2086
  stage prefix $PY -m benchmarks.gpu.bench_serve "$MODEL" "$OUT" $PREFIX_ARGS
  # shellcheck disable=SC2086
  stage scorer $PY -m benchmarks.gpu.correctness "$RANDOM_MODEL" "$OUT" $SCORER_CHECK
  # shellcheck disable=SC2086
  stage fp8 $PY -m benchmarks.gpu.correctness "$RANDOM_MODEL" "$OUT" $FP8_CHECK
  # shellcheck disable=SC2086
  stage "fp8 bench" $PY -m benchmarks.gpu.bench_serve "$MODEL" "$OUT" $FP8_BENCH
fi

{
  echo "# GPU job $(date -u +%FT%TZ) (dry run: $DRY, call: ${CALL:-none})"
  echo
  echo "| stage | status | time |"
  echo "|---|---|---|"
  printf '%s\n' "${SUMMARY[@]}"
  for f in correctness "${SHAPE_NAMES[@]/#/bench-}" bench-graphs bench-prefix correctness-kvzap correctness-fp8 \
    bench-fp8; do
    [[ -f $OUT/$f.md ]] && { echo; echo "## $f"; echo; cat "$OUT/$f.md"; }
  done
} > "$OUT/summary.md"
cat "$OUT/summary.md"
((FAILED == 0))  # the exit status: 0 when every stage that ran passed
