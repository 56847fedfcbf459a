#!/usr/bin/env bash
# The GPU check: build, selftest, the GPU tests, compute-sanitizer, the kernel benchmarks, one report.
#
#   bash bench_kernels/gpu_check.sh [--call 1|2|all] [--dry-run] OUT_DIR
#
# On a lent GPU machine (one H200, 15 min of device time per lease, its start included, <= 10 min per
# command, a bare machine at the start, warm for ~30 s after a call), in two commands:
#   call 1, timeout_s=510:  bash bench_kernels/gpu_check.sh --call 1 "$OUT"
#       environment; build in place (DINFER_CUDA=1, archs 90a, DINFER_WERROR=0: the image's compiler
#       is not the one CI proves warning-free; limit 200 s); then `python -m dinfer_kernels selftest`
#       (60 s), `pytest -m gpu` (270 s, 45 s per test, 4 pytest-xdist workers; SIGINT at the limit,
#       so junit and the log are always written), compute-sanitizer memcheck and racecheck on bench_kernels/kernel_calls.py
#       (45 s each). Budget 480 s.
#   call 2, timeout_s=250, AT ONCE after call 1 (the warm machine keeps call 1's build; on a bare one
#       the build reruns first):  bash bench_kernels/gpu_check.sh --call 2 "$OUT"
#       every bench_kernels/bench_*.py --quick --device cuda, the kernels' first, the engine's after;
#       each appends its JSON case by case, so a step cut at its limit loses at most the case in
#       flight. Budget 220 s.
#   Then hand the machine back. A machine's start (~1.5 min) + 510 s + 250 s stays inside the 15 minutes. Each
#   call returns OUT/report.md, report.json, gpu_check.log and raw.tar.gz (junit, logs, JSON: at most 8
#   files come back from the machine).
# --call all (the default) runs both calls' steps in one go, for a machine without those limits.
# --dry-run: the same plumbing on a CPU machine (host and interpreter backends, tiny shapes; no build:
#   the existing one is used; nothing is written into the checkout) and the same report, each section
#   saying what ran or why not. tests/bench/test_gpu_check.py runs it.
#
# Every step is timed, logged to OUT_DIR/gpu_check.log and OUT_DIR/<step>.log, and recorded in
# OUT_DIR/steps.tsv; a failing step is recorded and the script goes on. The steps together stay
# inside GPU_CHECK_BUDGET_S (call 1: 480, call 2: 220, all: 700, dry run: 280): each step's time
# limit is its own or what is left, whichever is smaller.
# Env overrides: PYTHON (default python3, else python), GPU_CHECK_BUDGET_S, BUILD_TIMEOUT_S (200),
# TEST_TIMEOUT_S (270), PER_TEST_TIMEOUT_S (45), GPU_CHECK_TEST_WORKERS (4; 0: none), BENCH_TIMEOUT_S
# (per script; by default its own),
# DINFER_CUDA_ARCHS (90a), MAX_JOBS (all cores).
set -u
CALL=all
DRY=0
while [ $# -gt 0 ]; do
  case $1 in
    --call) CALL=${2:?--call needs 1, 2 or all}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
case $CALL in 1|2|all) ;; *) echo "gpu_check.sh: --call must be 1, 2 or all, got $CALL" >&2; exit 2 ;; esac
OUT_DIR=${1:?usage: bash bench_kernels/gpu_check.sh [--call 1|2|all] [--dry-run] OUT_DIR}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
# Both packages from the checkout, uninstalled: dinfer and dinfer_kernels sit at the root.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT_DIR/gpu_check.log"
STEPS="$OUT_DIR/steps.tsv"
: >"$LOG"
: >"$STEPS"
PY=${PYTHON:-$(command -v python3 || command -v python)}
case "$DRY:$CALL" in
  1:*) DEFAULT_BUDGET=280; MODE="dry run" ;;
  0:1) DEFAULT_BUDGET=480; MODE="call 1" ;;
  0:2) DEFAULT_BUDGET=220; MODE="call 2" ;;
  *) DEFAULT_BUDGET=700; MODE="calls 1 and 2" ;;
esac
BUDGET=${GPU_CHECK_BUDGET_S:-$DEFAULT_BUDGET}
START=$(date +%s)
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ "$DRY" = 1 ]; then
  export PYTHONDONTWRITEBYTECODE=1      # nothing written into the checkout
  DEVICE=cpu
else
  DEVICE=cuda
fi

log() { echo "$*" | tee -a "$LOG"; }

skip_step() {  # skip_step NAME REASON
  log "=== [$1] skipped: $2"
  printf '%s\tskipped\t0\t%s\n' "$1" "$2" >>"$STEPS"
}

# run_step NAME TIMEOUT CMD... : timed, logged to OUT_DIR/NAME.log too, never aborts the script. At
# the limit the command gets SIGINT (pytest then writes its junit, a benchmark keeps its JSON), and
# SIGKILL 15 s later.
run_step() {
  local name=$1 tmo=$2; shift 2
  local now left rc t0 t1 secs note=""
  now=$(date +%s); left=$((BUDGET - (now - START) - 15))     # keep 15 s for the report
  if [ "$left" -lt 10 ]; then
    skip_step "$name" "the budget of ${BUDGET}s is used up"
    return 0
  fi
  [ "$tmo" -gt "$left" ] && tmo=$left
  log ""
  log "=== [$name] $(date -u +%FT%TZ) limit ${tmo}s: $*"
  t0=$(date +%s.%N)
  timeout -s INT -k 15 "$tmo" "$@" 2>&1 | tee "$OUT_DIR/$name.log" >>"$LOG"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s.%N)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    note="stopped at its limit of ${tmo}s"
  fi
  log "=== [$name] exit $rc in ${secs}s${note:+ ($note)}"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$note" >>"$STEPS"
  return 0
}

has_cuda_build() {
  "$PY" -c 'import sys
from dinfer_kernels import _backend
ext = _backend.compiled()
sys.exit(0 if ext is not None and ext.built_with_cuda() else 1)' 2>/dev/null
}

log "gpu_check ($MODE): repo $REPO, commit $(git rev-parse HEAD 2>/dev/null || echo unknown)," \
  "python $PY, budget ${BUDGET}s"

# ---- environment -------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  skip_step nvidia-smi "dry run: no GPU"
else
  run_step nvidia-smi 20 nvidia-smi
fi
# shellcheck disable=SC2016  # expanded by the inner shell
run_step versions 60 bash -c '"$0" bench_kernels/report.py versions; nvcc --version | tail -1
cmake --version | head -1; echo "ninja $(ninja --version)"; gcc --version | head -1
command -v compute-sanitizer || echo "compute-sanitizer: not found"; echo "cores $(nproc)"' "$PY"
cp "$OUT_DIR/versions.log" "$OUT_DIR/environment.txt" 2>/dev/null

# ---- build -------------------------------------------------------------------------------------
build() {
  run_step build "${BUILD_TIMEOUT_S:-200}" env DINFER_CUDA=1 DINFER_WERROR=0 \
    DINFER_CUDA_ARCHS="${DINFER_CUDA_ARCHS:-90a}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" env -C kernels "$PY" setup.py build_ext --inplace
  if [ -f dinfer_kernels/build_log.txt ]; then
    cp dinfer_kernels/build_log.txt "$OUT_DIR/build_log.txt"
    grep -E "spill|bytes stack frame" dinfer_kernels/build_log.txt | sort | uniq -c | sort -rn | head -30 \
      >"$OUT_DIR/ptxas.txt"
  fi
}
if [ "$DRY" = 1 ]; then
  skip_step build "dry run: the existing build is used (the checkout is never rebuilt in place)"
elif [ "$CALL" = 2 ] && has_cuda_build; then
  skip_step build "call 2 reuses call 1's build on this warm machine"
else
  build
fi
run_step dinfer_kernels-info 60 "$PY" -m dinfer_kernels
cat "$OUT_DIR/dinfer_kernels-info.log" >>"$OUT_DIR/environment.txt" 2>/dev/null

# ---- call 1: selftest, GPU tests, sanitizer ------------------------------------------------------
if [ "$CALL" != 2 ] || [ "$DRY" = 1 ]; then
  if [ "$DRY" = 1 ]; then
    run_step selftest 120 "$PY" -m dinfer_kernels selftest --quick --device cpu --json "$OUT_DIR/selftest.json"
  else
    run_step selftest 60 "$PY" -m dinfer_kernels selftest --json "$OUT_DIR/selftest.json"
  fi

  per_test=${PER_TEST_TIMEOUT_S:-45}
  if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
    test_args=(--timeout "$per_test")
  else
    test_args=()
    export DINFER_TEST_TIMEOUT_S=$per_test
  fi
  # Workers share the one GPU: the kernels' JIT compiles and the host-side references run in
  # parallel (pytest-xdist is on the device image; junit is still written when stopped).
  workers=${GPU_CHECK_TEST_WORKERS:-4}
  if [ "$DRY" = 0 ] && [ "$workers" -gt 0 ] && "$PY" -c 'import xdist' 2>/dev/null; then
    test_args+=(-n "$workers")
  fi
  # Hypothesis keeps its example database in a temporary folder, not in the checkout (the dry run
  # writes nothing there).
  hypothesis_dir=$(mktemp -d)
  run_step gpu-tests "${TEST_TIMEOUT_S:-270}" env HYPOTHESIS_STORAGE_DIRECTORY="$hypothesis_dir" \
    "$PY" -m pytest -q -rfE -p no:cacheprovider -m gpu \
    "${test_args[@]}" --junitxml "$OUT_DIR/junit.xml" -o junit_family=xunit2 tests
  rm -rf "$hypothesis_dir"

  run_step kernel-calls 30 "$PY" bench_kernels/kernel_calls.py --device "$DEVICE"
  if [ "$DRY" = 1 ]; then
    skip_step memcheck "dry run: no GPU"
    skip_step racecheck "dry run: no GPU"
  elif ! command -v compute-sanitizer >/dev/null; then
    skip_step memcheck "compute-sanitizer not found"
    skip_step racecheck "compute-sanitizer not found"
  else
    for tool in memcheck racecheck; do
      run_step "$tool" 45 compute-sanitizer --tool "$tool" --error-exitcode 1 --print-limit 20 \
        "$PY" bench_kernels/kernel_calls.py --device cuda
    done
  fi
fi

# ---- call 2: benchmarks --------------------------------------------------------------------------
# Each script's limit in a real call (seconds; together they fit call 2's budget; 60 in the dry run,
# whose host is slow and shared) and its tiny shapes in the dry run.
bench_limit() {
  [ "$DRY" = 1 ] && { echo 60; return; }
  case $1 in
    bench_attention) echo 50 ;; bench_moe) echo 35 ;; bench_decode) echo 35 ;;
    bench_soft_embedding|bench_norm_rope|bench_host_isa|bench_e2e) echo 20 ;; *) echo 12 ;;
  esac
}
bench_tiny() {
  case $1 in
    bench_attention) echo "--dtype fp32 --windows 128 --refresh 64 --window-rows 16 --densities 1 --heads 2" \
                          "--head-dim 64 --no-flex --reps 2 --paged-prefixes 64 --paged-heads 2" \
                          "--paged-kv-heads 1 --paged-head-dim 64" ;;
    bench_moe) echo "--tokens 4 --experts 8 --top-k 2 --hidden 64 --inter 32 --reps 2" ;;
    bench_decode) echo "--dtype fp32 --rows 4 --vocab 1000 --no-compile --reps 2" ;;
    bench_soft_embedding) echo "--dtype fp32 --rows 4 --vocab 1000 --dim 64 --reps 2" ;;
    bench_norm_rope) echo "--dtype fp32 --rows 1 --reps 2" ;;
    bench_host_isa) echo "--isas generic --dtypes fp32" ;;
    bench_parallel) echo "--world 1,2 --batch 1 --seq 8 --rows 4 --vocab 1000 --reps 1" ;;
    bench_loop) echo "--hidden 64 --layers 1 --experts 4 --vocab 256 --gen-length 16 --block-length 8" ;;
    bench_forward) echo "--tiny --seq 96 --batch 1 --reps 2" ;;
    *) echo "--num-problems 1 --tasks add" ;;
  esac
}
if [ "$CALL" != 1 ] || [ "$DRY" = 1 ]; then
  names=$("$PY" -c 'import sys; sys.path.insert(0, "bench_kernels"); import report
print(" ".join(report.bench_names()))')
  for name in $names; do
    extra=()
    [ "$DRY" = 1 ] && read -r -a extra <<<"$(bench_tiny "$name")"
    run_step "$name" "${BENCH_TIMEOUT_S:-$(bench_limit "$name")}" "$PY" "bench_kernels/$name.py" --quick \
      --device "$DEVICE" --json "$OUT_DIR/$name.json" "${extra[@]}"
  done
fi

# ---- report --------------------------------------------------------------------------------------
"$PY" bench_kernels/report.py report "$OUT_DIR" --mode "$MODE" 2>&1 | tee -a "$LOG"
log "gpu_check: done in $(( $(date +%s) - START ))s"

# What comes back from the device machine is at most 8 files: everything but the report and the log
# is packed into raw.tar.gz.
(cd "$OUT_DIR" && find . -maxdepth 1 -type f ! -name report.md ! -name report.json ! -name gpu_check.log \
   ! -name raw.tar.gz -printf '%f\n' | sort >raw.list && tar czf raw.tar.gz -T raw.list &&
   xargs rm -f <raw.list && rm -f raw.list)
cat "$OUT_DIR/report.md" 2>/dev/null
exit 0
