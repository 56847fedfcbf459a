#!/usr/bin/env bash
# One command for a fresh GPU machine (no network):  bash bench_kernels/gpu_check.sh OUT_DIR
#
# Steps, each timed, logged to OUT_DIR/gpu_check.log and recorded in OUT_DIR/steps.tsv; a failing
# step is recorded and the script goes on:
#   1. environment: nvidia-smi, tool versions, python -m dinfer_kernels
#   2. build in place, no network: pip install --no-build-isolation --no-deps -e .
#      with DINFER_CUDA=1 DINFER_CUDA_ARCHS=90a (fallback: setup.py build_ext --inplace)
#   3. tests: pytest -m "not slow" tests --junitxml OUT_DIR/junit.xml
#   4. every bench_kernels/bench_*.py --quick --device cuda --json OUT_DIR/<name>.json (discovered;
#      the kernels' benchmarks first)
#   5. OUT_DIR/report.md + report.json (python bench_kernels/common.py report OUT_DIR)
# The whole run stays inside GPU_CHECK_BUDGET_S seconds (default 450): each step's timeout is its
# default or what is left of the budget, whichever is smaller.
# Env overrides: PYTHON, GPU_CHECK_BUDGET_S, BUILD_TIMEOUT_S (240), TEST_TIMEOUT_S (150),
# BENCH_TIMEOUT_S (120 per script), GPU_CHECK_SKIP_BUILD=1, GPU_CHECK_MAX_FILES (8: when OUT_DIR
# would hold more files than that, the raw files are packed into OUT_DIR/raw.tar.gz; report.json
# holds every result anyway).
set -u
OUT_DIR=${1:?usage: bash bench_kernels/gpu_check.sh OUT_DIR}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
LOG="$OUT_DIR/gpu_check.log"
STEPS="$OUT_DIR/steps.tsv"
: >"$LOG"
: >"$STEPS"
PY=${PYTHON:-$(command -v python || command -v python3)}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
START=$(date +%s)
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "$*" | tee -a "$LOG"; }

# run_step NAME DEFAULT_TIMEOUT CMD... : timed, logged, never aborts the script
run_step() {
  local name=$1 tmo=$2; shift 2
  local now left rc t0 t1
  now=$(date +%s); left=$((BUDGET - (now - START) - 20))     # keep 20 s for the report
  if [ "$left" -lt 10 ]; then
    log "=== [$name] SKIPPED: budget of ${BUDGET}s used up"
    printf '%s\t%s\t%s\n' "$name" "skipped" "0" >>"$STEPS"
    return 0
  fi
  [ "$tmo" -gt "$left" ] && tmo=$left
  log ""
  log "=== [$name] $(date -u +%FT%TZ) timeout ${tmo}s: $*"
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$tmo" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s.%N)
  local secs; secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
  [ "$rc" -eq 124 ] && log "=== [$name] TIMED OUT after ${tmo}s"
  log "=== [$name] exit $rc in ${secs}s"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$secs" >>"$STEPS"
  return 0
}

log "gpu_check: repo $REPO, commit $(git rev-parse HEAD 2>/dev/null || echo unknown), python $PY, budget ${BUDGET}s"

# 1. environment ---------------------------------------------------------------------------------
run_step nvidia-smi 20 nvidia-smi
run_step versions 30 bash -c "'$PY' --version; '$PY' -c 'import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"gpu\", torch.cuda.is_available() and torch.cuda.get_device_name(0)); print(\"triton\", triton.__version__)'; nvcc --version | tail -2; cmake --version | head -1; ninja --version; '$PY' -c 'import pybind11; print(\"pybind11\", pybind11.__version__)'"

# 2. build ---------------------------------------------------------------------------------------
if [ "${GPU_CHECK_SKIP_BUILD:-0}" != "1" ]; then
  export DINFER_CUDA=1 DINFER_CUDA_ARCHS=${DINFER_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-$(nproc)}
  run_step build "${BUILD_TIMEOUT_S:-240}" "$PY" -m pip install --no-build-isolation --no-deps -e .
  if [ "$(tail -1 "$STEPS" | cut -f2)" != "0" ]; then
    run_step build-inplace "${BUILD_TIMEOUT_S:-240}" "$PY" setup.py build_ext --inplace
  fi
  if [ -f dinfer_kernels/build_log.txt ]; then
    log "--- ptxas resource report (dinfer_kernels/build_log.txt)"
    grep -E "ptxas info|spill|bytes stack frame" dinfer_kernels/build_log.txt | head -60 | tee -a "$LOG" >/dev/null
  fi
fi
run_step dinfer_kernels-info 60 "$PY" -m dinfer_kernels

# 3. tests ---------------------------------------------------------------------------------------
run_step tests "${TEST_TIMEOUT_S:-150}" "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests \
  --junitxml "$OUT_DIR/junit.xml" -o junit_family=xunit2

# 4. benchmarks (discovered) ---------------------------------------------------------------------
# The kernels' benchmarks first (their targets need a GPU), then the engine-level ones, so that a
# budget that runs out cuts the least GPU-specific ones.
FIRST="bench_attention bench_moe bench_decode bench_soft_embedding"
for name in $FIRST $(ls bench_kernels/bench_*.py | xargs -n1 basename | sed 's/\.py$//' | grep -v -x -F -f <(tr ' ' '\n' <<<"$FIRST")); do
  f=bench_kernels/$name.py
  [ -f "$f" ] || continue
  run_step "$name" "${BENCH_TIMEOUT_S:-120}" "$PY" "$f" --quick --device cuda --json "$OUT_DIR/$name.json"
done

# 5. report --------------------------------------------------------------------------------------
"$PY" bench_kernels/common.py report "$OUT_DIR" 2>&1 | tee -a "$LOG"
log "gpu_check: done in $(( $(date +%s) - START ))s"

# keep what comes back small: pack the raw files if there are too many
nfiles=$(find "$OUT_DIR" -maxdepth 1 -type f | wc -l)
if [ "$nfiles" -gt "${GPU_CHECK_MAX_FILES:-8}" ]; then
  (cd "$OUT_DIR" && raw=$(ls | grep -v -x -E 'report\.md|report\.json|gpu_check\.log|raw\.tar\.gz') && \
   tar czf raw.tar.gz $raw && rm -f $raw && echo "packed into raw.tar.gz: $raw" | tr '\n' ' ' >>gpu_check.log)
fi
cat "$OUT_DIR/report.md" 2>/dev/null
exit 0
