#!/usr/bin/env bash
# The GPU check: what a lent GPU machine must prove and measure, as ONE command, and the rest as an
# optional second one.
#
#   bash bench_kernels/gpu_check.sh [--more] [--dry-run] OUT_DIR
#   bash bench_kernels/gpu_check.sh [--more] --plan          # the steps and their limits; no run
#
# A lent machine (an H100 or an H200) gives 15 min of device time, its start (1-2 min, more after a
# failed start) included, <= 10 min a command. So the value comes first, in one command of <= 540 s
# (call it with timeout_s ~570):  bash bench_kernels/gpu_check.sh "$OUT"
#   environment  12 s  nvidia-smi (model, -q -d CLOCK,POWER), versions (python, torch, triton, nvcc,
#                      driver), whether nsys / ncu / compute-sanitizer are there
#   build       120 s  DINFER_CUDA=1, archs 90a, host ISA generic only (DINFER_CPU_ISAS), DINFER_WERROR=0
#                      (the image's compiler is not the one CI proves warning-free); incremental on a
#                      warm machine
#   selftest     40 s  python -m dinfer_kernels (what was built), then its selftest
#   gpu-tests    90 s  first the GPU tests of the fixes never run on a GPU (-k "$FIXES" below: paged
#                      attention and its capture, rule='joint', the bindings' errors, graph capture in
#                      the engine, the parallel ops, the rope table, the profiler ranges), then the other GPU tests
#                      with what is left
#   bench_forward 110 s  one model forward at the released shapes (--quick --time-limit)
#   e2e_synthetic 45 s  the engine's tokens/s at both released shapes (bench_e2e.py --synthetic
#                      llada-moe-7b, then llada2-mini, each under half the limit: random weights, every
#                      layer, prompts of 64, 64 tokens generated, batch 1 and 32, graphs on and off)
#   hero         68 s  the kernel cases that decide a forward, one process (bench_kernels/hero_cases.py);
#                      the MoE step first: bench_moe at both released layers (--shape llada-moe, then
#                      llada2-mini with its grouped sigmoid router and shared expert), T = 32 and 2048,
#                      bf16 and FP8 weights, torch._grouped_mm alone beside ours[cuda] (moe_<shape>_<gpu>.json;
#                      Triton rows and ours with the GEMMs by _grouped_mm: --more)
#   nsys         30 s  one forward under nsys (bench_forward.py --nsys-one); `nsys stats` into the report
#   report       15 s  report.md, report.json, raw.tar.gz
# Second, optional, on the warm machine (its build is reused):  bash bench_kernels/gpu_check.sh --more "$OUT"
#   every GPU test, compute-sanitizer memcheck / racecheck on bench_kernels/kernel_calls.py, and every
#   benchmark (--quick; bench_forward without it, to its time limit), each under its own limit.
# --plan prints a call's steps and limits and their sum, which tests/bench/test_gpu_check.py holds to
# <= 540 s for both calls. --dry-run: the same steps on a CPU machine (host and interpreter backends,
# tiny shapes; no build: the existing one is used; nothing written into the checkout), each limit at
# least 60 s (a slow, shared host) and all of them inside 280 s; tests/bench/test_gpu_check.py runs it.
#
# Every step is timed, logged to OUT_DIR/gpu_check.log and OUT_DIR/<step>.log, and recorded in
# OUT_DIR/steps.tsv; a failing step is recorded and the script goes on. At its limit a step gets SIGINT
# (pytest writes its junit, a benchmark keeps the cases it finished: each appends its JSON case by
# case), and SIGKILL 5 s later, inside the limit. A step never runs past what is left of the budget.
# Benchmark results are OUT_DIR/<bench>_<gpu>.json (forward_h100.json, moe_llada2-mini_h200.json): the GPU
# in the name (environment.gpu_slug), so numbers from two GPUs never meet in one file or one ratio.
# At most 8 files come back from the machine: report.md, report.json, gpu_check.log and raw.tar.gz
# (junit, logs, JSON, the nsys summary).
# Env overrides: PYTHON (default python3, else python), PER_TEST_TIMEOUT_S (30), GPU_CHECK_TEST_WORKERS
# (4; 0: none), MAX_JOBS (all cores).
set -u
MORE=0
DRY=0
PLAN=0
while [ $# -gt 0 ]; do
  case $1 in
    --more) MORE=1; shift ;;
    --dry-run) DRY=1; shift ;;
    --plan) PLAN=1; shift ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)

# The GPU tests of the fixes made after the last GPU run (802ee3b), none of which ran on a GPU yet.
# qk_rope's own GPU cases (54, most a fresh Triton compile) run with the rest: the model forwards of
# bench_forward run its kernel anyway, and here they would crowd out the paged and joint tests.
FIXES="(paged or joint or capture or graph or binding or parallel or rope_table or profil) and not test_qk_rope"

# ---- the plan: each call's steps and their limits in seconds --------------------------------------
ONE_CALL="environment:12 build:120 selftest:40 gpu-tests:90 bench_forward:110 e2e_synthetic:45 hero:68 nsys:30 report:15"
# Each benchmark's limit in --more (the kernels' first: their numbers need the GPU; then the engine's).
bench_limit() {
  case $1 in
    bench_attention) echo 33 ;; bench_forward) echo 30 ;; bench_moe) echo 25 ;; bench_decode) echo 20 ;;
    bench_e2e) echo 18 ;; bench_soft_embedding) echo 12 ;; *) echo 10 ;;
  esac
}
# Tiny shapes of each benchmark for the dry run.
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
bench_scripts() {
  local first="bench_attention bench_moe bench_decode bench_soft_embedding bench_norm_rope bench_forward" n
  for n in $first; do [ -f "bench_kernels/$n.py" ] && echo "$n"; done
  for n in $(cd bench_kernels && ls bench_*.py | sed 's/\.py$//'); do
    case " $first " in *" $n "*) ;; *) echo "$n" ;; esac
  done
}
more_call() {
  local plan="environment:12 build:120 gpu-tests:100 kernel-calls:12 memcheck:26 racecheck:26" n
  for n in $(bench_scripts); do plan="$plan $n:$(bench_limit "$n")"; done
  echo "$plan report:15"
}
if [ "$MORE" = 1 ]; then PLAN_STEPS=$(more_call); MODE="more"; else PLAN_STEPS=$ONE_CALL; MODE="one call"; fi
planned() {  # planned STEP: the step's limit in the plan
  local s
  for s in $PLAN_STEPS; do [ "${s%%:*}" = "$1" ] && { echo "${s##*:}"; return; }; done
  echo "gpu_check.sh: no step $1 in the plan" >&2; exit 3
}
if [ "$PLAN" = 1 ]; then
  total=0
  for s in $PLAN_STEPS; do printf '%s\t%s\n' "${s%%:*}" "${s##*:}"; total=$((total + ${s##*:})); done
  printf 'total\t%s\n' "$total"
  exit 0
fi

OUT_DIR=${1:?usage: bash bench_kernels/gpu_check.sh [--more] [--dry-run] OUT_DIR}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
# Both packages from the checkout, uninstalled: dinfer and dinfer_kernels sit at the root.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT_DIR/gpu_check.log"
STEPS="$OUT_DIR/steps.tsv"
: >"$LOG"
: >"$STEPS"
PY=${PYTHON:-$(command -v python3 || command -v python)}
BUDGET=0
for s in $PLAN_STEPS; do BUDGET=$((BUDGET + ${s##*:})); done
[ "$DRY" = 1 ] && { BUDGET=280; MODE="$MODE, dry run"; }
REPORT_S=$(planned report)
START=$(date +%s)
GRACE=5   # seconds between SIGINT and SIGKILL, inside a step's limit
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

# step_limit NAME [SECONDS]: the step's limit (its plan's, or SECONDS), cut to what is left of the budget
# less the report's time; at least 60 s in the dry run (a slow, shared host). Below 10 s: 0 (skip it).
step_limit() {
  local tmo=${2:-$(planned "$1")} left
  [ "$DRY" = 1 ] && [ "$tmo" -lt 60 ] && tmo=60
  left=$((BUDGET - ($(date +%s) - START) - REPORT_S))
  [ "$tmo" -gt "$left" ] && tmo=$left
  [ "$tmo" -lt 10 ] && tmo=0
  echo "$tmo"
}

# run_step NAME LIMIT CMD... : timed, logged to OUT_DIR/NAME.log too, never aborts the script. At
# LIMIT - GRACE seconds the command gets SIGINT (pytest then writes its junit, a benchmark keeps its
# JSON), at LIMIT SIGKILL. LIMIT 0: skipped, the budget is used up.
run_step() {
  local name=$1 tmo=$2; shift 2
  local rc t0 t1 secs note=""
  if [ "$tmo" -le 0 ]; then
    skip_step "$name" "the budget of ${BUDGET}s is used up"
    return 0
  fi
  log ""
  log "=== [$name] $(date -u +%FT%TZ) limit ${tmo}s: $*"
  t0=$(date +%s.%N)
  timeout -s INT -k "$GRACE" "$((tmo - GRACE))" "$@" 2>&1 | tee "$OUT_DIR/$name.log" >>"$LOG"
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

log "gpu_check ($MODE): repo $REPO, commit $(git rev-parse HEAD 2>/dev/null || echo unknown)," \
  "python $PY, budget ${BUDGET}s"

# ---- environment ---------------------------------------------------------------------------------
# The fast facts first (nvidia-smi, the tools), the Python versions (imports torch) last.
environment_facts() {
  if command -v nvidia-smi >/dev/null; then
    echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit \
      --format=csv
    nvidia-smi -q -d CLOCK,POWER
  else
    echo "nvidia-smi: not found"
  fi
  local t
  for t in nvcc nsys ncu compute-sanitizer cmake ninja gcc; do
    echo "$t: $(command -v "$t" || echo 'not found')"
  done
  command -v nvcc >/dev/null && nvcc --version | tail -2
  command -v nsys >/dev/null && nsys --version
  command -v ncu >/dev/null && ncu --version | tail -1
  echo "cores $(getconf _NPROCESSORS_ONLN)"
  "$PY" bench_kernels/report.py versions
}
export -f environment_facts
export PY
run_step environment "$(step_limit environment)" bash -c environment_facts
cp "$OUT_DIR/environment.log" "$OUT_DIR/environment.txt" 2>/dev/null
# The GPU's name: nvidia-smi's, else torch's (the versions line "torch ... gpu NAME").
GPU_NAME=""
if [ "$DRY" = 0 ] && [ -f "$OUT_DIR/environment.log" ]; then
  GPU_NAME=$(sed -n 's/^gpu: //p' "$OUT_DIR/environment.log" | head -1)
  [ -z "$GPU_NAME" ] && GPU_NAME=$(sed -n 's/^torch .* gpu \(.*\)$/\1/p' "$OUT_DIR/environment.log" | grep -v '^None$' | head -1)
fi
SLUG=$("$PY" bench_kernels/environment.py slug "$GPU_NAME")
log "results named *_${SLUG}.json (GPU: ${GPU_NAME:-none})"

# ---- build -------------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  skip_step build "dry run: the existing build is used (the checkout is never rebuilt in place)"
else
  run_step build "$(step_limit build)" env DINFER_CUDA=1 DINFER_WERROR=0 DINFER_CUDA_ARCHS=90a \
    DINFER_CPU_ISAS=generic MAX_JOBS="${MAX_JOBS:-$(getconf _NPROCESSORS_ONLN)}" "$PY" setup.py build_ext --inplace
  if [ -f dinfer_kernels/build_log.txt ]; then
    cp dinfer_kernels/build_log.txt "$OUT_DIR/build_log.txt"
    grep -E "spill|bytes stack frame" dinfer_kernels/build_log.txt | sort | uniq -c | sort -rn | head -30 \
      >"$OUT_DIR/ptxas.txt"
  fi
fi

# ---- GPU tests -------------------------------------------------------------------------------------
per_test=${PER_TEST_TIMEOUT_S:-30}
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
  test_args=(--timeout "$per_test")
else
  test_args=()
  export DINFER_TEST_TIMEOUT_S=$per_test
fi
# Workers share the one GPU: the kernels' JIT compiles and the host-side references run in parallel
# (pytest-xdist is on the device image; junit is still written when stopped).
workers=${GPU_CHECK_TEST_WORKERS:-4}
if [ "$DRY" = 0 ] && [ "$workers" -gt 0 ] && "$PY" -c 'import xdist' 2>/dev/null; then
  test_args+=(-n "$workers")
fi
# gpu_tests NAME LIMIT [PYTEST ARGS...]: `pytest -m gpu` into OUT_DIR/junit-NAME.xml. Hypothesis keeps
# its example database in a temporary folder, not in the checkout (the dry run writes nothing there).
gpu_tests() {
  local name=$1 tmo=$2 hypothesis_dir; shift 2
  hypothesis_dir=$(mktemp -d)
  run_step "$name" "$tmo" env HYPOTHESIS_STORAGE_DIRECTORY="$hypothesis_dir" \
    "$PY" -m pytest -q -rfE -p no:cacheprovider -m gpu "$@" "${test_args[@]}" \
    --junitxml "$OUT_DIR/junit-$name.xml" -o junit_family=xunit2 tests
  rm -rf "$hypothesis_dir"
}

# bench_json NAME: the JSON file of benchmark NAME (bench_moe) in this run: OUT_DIR/moe_h100.json
bench_json() { echo "$OUT_DIR/${1#bench_}_${SLUG}.json"; }

if [ "$MORE" = 0 ]; then
  # ---- selftest ----------------------------------------------------------------------------------
  if [ "$DRY" = 1 ]; then selftest_args=(--quick --device cpu); else selftest_args=(); fi
  # shellcheck disable=SC2016  # expanded by the inner shell
  run_step selftest "$(step_limit selftest)" bash -c '"$0" -m dinfer_kernels; exec "$0" -m dinfer_kernels selftest "$@"' \
    "$PY" "${selftest_args[@]}" --json "$OUT_DIR/selftest.json"

  # ---- GPU tests: the never-run fixes first, then the others with what is left -------------------
  tests_end=$(( $(date +%s) + $(step_limit gpu-tests) ))
  gpu_tests gpu-tests-fixes "$(step_limit gpu-tests)" -k "$FIXES"
  gpu_tests gpu-tests-rest "$(step_limit gpu-tests $((tests_end - $(date +%s))))" -k "not ($FIXES)"

  # ---- one model forward at the released shapes --------------------------------------------------
  if [ ! -f bench_kernels/bench_forward.py ]; then
    skip_step bench_forward "missing: bench_kernels/bench_forward.py is not in this checkout"
  else
    lim=$(step_limit bench_forward)
    fwd_args=()
    [ "$DRY" = 1 ] && read -r -a fwd_args <<<"$(bench_tiny bench_forward)"
    run_step bench_forward "$lim" "$PY" bench_kernels/bench_forward.py --device "$DEVICE" --quick \
      --time-limit "$((lim > 30 ? lim - 15 : lim / 2))" --json "$(bench_json forward)" "${fwd_args[@]}"
  fi

  # ---- the engine's tokens/s at the released shapes: both models, each under half the limit -------
  lim=$(step_limit e2e_synthetic)
  if [ "$DRY" = 1 ]; then syn_args=(--tiny --concurrent 3); else syn_args=(--concurrent 32); fi
  # shellcheck disable=SC2016  # expanded by the inner shell
  run_step e2e_synthetic "$lim" bash -c '
    py=$0 each=$1 moe=$2 mini=$3 rc=0; shift 3
    for m in "llada-moe-7b:$moe" "llada2-mini:$mini"; do
      timeout -s INT -k 2 "$each" "$py" bench_kernels/bench_e2e.py --synthetic "${m%%:*}" --quick \
        --gen-length 64 --prompt-len 64 --json "${m#*:}" "$@" || rc=$?
    done
    exit $rc' "$PY" "$((lim > 19 ? (lim - GRACE) / 2 - 2 : 3))" "$(bench_json e2e_synthetic_llada-moe-7b)" \
    "$(bench_json e2e_synthetic_llada2-mini)" --device "$DEVICE" "${syn_args[@]}"

  # ---- the hero kernel cases ---------------------------------------------------------------------
  lim=$(step_limit hero)
  hero_args=(--device "$DEVICE" --out "$OUT_DIR" --gpu "$SLUG" --time-limit "$((lim > 20 ? lim - 10 : lim / 2))")
  [ "$DRY" = 1 ] && hero_args+=(--tiny)
  run_step hero "$lim" "$PY" bench_kernels/hero_cases.py "${hero_args[@]}"

  # ---- nsys: one forward -------------------------------------------------------------------------
  if [ "$DRY" = 1 ]; then
    skip_step nsys "dry run: no GPU"
  elif ! command -v nsys >/dev/null; then
    skip_step nsys "nsys not found on this machine"
  elif [ ! -f bench_kernels/bench_forward.py ]; then
    skip_step nsys "missing: bench_kernels/bench_forward.py (--nsys-one) is not in this checkout"
  else
    # NSYS_NVTX_PROFILER_REGISTER_ONLY=0: torch's NVTX ranges are unregistered strings, which
    # --capture-range=nvtx otherwise ignores.
    # shellcheck disable=SC2016  # expanded by the inner shell
    run_step nsys "$(step_limit nsys)" env NSYS_NVTX_PROFILER_REGISTER_ONLY=0 bash -c '
      nsys profile -o "$1/forward_one" --force-overwrite true -t cuda,nvtx --cuda-graph-trace=node \
        --capture-range=nvtx --nvtx-capture=bench_forward.one --capture-range-end=stop \
        "$0" bench_kernels/bench_forward.py --device cuda --nsys-one &&
      nsys stats --report cuda_gpu_kern_sum,nvtx_sum "$1/forward_one.nsys-rep" >"$1/nsys_stats.txt"
      rc=$?; rm -f "$1/forward_one.sqlite"; exit $rc' "$PY" "$OUT_DIR"
  fi
else
  # ---- --more: every GPU test, the sanitizer, every benchmark ------------------------------------
  gpu_tests gpu-tests "$(step_limit gpu-tests)"
  run_step kernel-calls "$(step_limit kernel-calls)" "$PY" bench_kernels/kernel_calls.py --device "$DEVICE"
  if [ "$DRY" = 1 ]; then
    skip_step memcheck "dry run: no GPU"
    skip_step racecheck "dry run: no GPU"
  elif ! command -v compute-sanitizer >/dev/null; then
    skip_step memcheck "compute-sanitizer not found"
    skip_step racecheck "compute-sanitizer not found"
  else
    for tool in memcheck racecheck; do
      run_step "$tool" "$(step_limit "$tool")" compute-sanitizer --tool "$tool" --error-exitcode 1 \
        --print-limit 20 "$PY" bench_kernels/kernel_calls.py --device cuda
    done
  fi
  for name in $(bench_scripts); do
    lim=$(step_limit "$name")
    args=(--quick)
    # bench_forward's --quick rows ran in the one call: here its whole set, stopped at its time limit.
    [ "$name" = bench_forward ] && args=(--time-limit "$((lim > 30 ? lim - 15 : lim / 2))")
    [ "$DRY" = 1 ] && read -r -a extra <<<"$(bench_tiny "$name")" && args+=("${extra[@]}")
    run_step "$name" "$lim" "$PY" "bench_kernels/$name.py" --device "$DEVICE" --json "$(bench_json "$name")" \
      "${args[@]}"
  done
fi

# ---- report --------------------------------------------------------------------------------------
timeout -k 2 "$((REPORT_S - 5))" "$PY" bench_kernels/report.py report "$OUT_DIR" --mode "$MODE" 2>&1 | tee -a "$LOG"
log "gpu_check: done in $(( $(date +%s) - START ))s"

# What comes back from the device machine is at most 8 files of <= 16 MiB: everything but the report and
# the log is packed into raw.tar.gz, without an nsys capture over 8 MiB (its summary is in the report).
find "$OUT_DIR" -maxdepth 1 -name '*.nsys-rep' -size +8M -printf '%f: over 8 MiB, not kept\n' -delete | tee -a "$LOG"
(cd "$OUT_DIR" && find . -maxdepth 1 -type f ! -name report.md ! -name report.json ! -name gpu_check.log \
   ! -name raw.tar.gz ! -name raw.list -printf '%f\n' | sort >raw.list && tar czf raw.tar.gz -T raw.list &&
   xargs rm -f <raw.list && rm -f raw.list)
cat "$OUT_DIR/report.md" 2>/dev/null
exit 0
