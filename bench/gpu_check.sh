#!/usr/bin/env bash
# One-shot check of TrainSan on a GPU machine (e.g. a lent H200 with torch, nvcc, CMake, ninja and
# pytest, maybe without GoogleTest, scikit-build-core or internet). Phases, each timed and bounded,
# each run even when an earlier one failed (unless it needs what failed), summary at the end:
#   env        versions, the GPU torch sees
#   gtest      probe: is GoogleTest installed? (the C++ suites are built only if it is)
#   configure  plain CMake into $BUILD_DIR (default build/gpu), Release, CUDA on
#   build      the op library (and the test programs when GoogleTest is there)
#   ctest-gpu  the GPU-labelled C++ tests (ctest -L gpu)
#   dev-stop   bench/gpu_step_tier.py --phase stop (device_stop=True: a NaN gradient stops it)
#   step-tier  bench/gpu_step_tier.py --phase tier (the every-step tier: step-time ratio, launches
#              and syncs per step, the pass against torch._foreach_norm)
#   mem-gpu    bench/bench_overhead.py --device cuda --memory --no-timing (issue 35: a fresh process
#              per contender; torch.cuda.max_memory_allocated above plain on the 67M MLP with Adam,
#              bar <= 2 % of the weights; the trace's bytes per step on the 146-tensor stack between
#              steps 300 and 600, bar <= 1 KiB)
#   pytest     tests/python against the built library (TRAINSAN_LIBRARY, PYTHONPATH=bindings)
#   stacks-gpu bench/gpu_stacks.py (DDP over single-rank NCCL, FSDP2 world size 1, inductor)
#   gpu-bench  bench/gpu_bench.py (2 GiB bf16 and fp32 over 300 tensors)
#   gpt2-bench bench/bench_gpt2_gpu.py (sanitizer overhead on a GPT-2-small bf16 training step)
#   desync-gpu bench/bench_overhead.py --contenders desync --device cuda (rank_desync's cost, two
#              ranks on one GPU)
#   prec-gpu   bench/bench_overhead.py --contenders precision --device cuda (overflow provenance
#              under fp16 + scaler)
# The whole run stays within GPU_CHECK_BUDGET_S seconds (default 540, so under 9 minutes): a phase
# gets at most its own limit and what is left of the budget.
#
# Usage: bash bench/gpu_check.sh [--dry-run]
#   --dry-run  print the phases, their limits and commands; run nothing
# Environment: BUILD_DIR (build/gpu), PYTHON (python3), CUDA_ARCHS (90: the H200's sm_90),
#   JOBS (all cores), GPU_CHECK_BUDGET_S (540), GTEST (auto, or ON/OFF instead of the probe).
# Logs go to $BUILD_DIR/gpu_check/, and are copied to $OUT when that is set. Exit status: the
# number of failed phases.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h | --help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build/gpu}
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$ROOT/$BUILD_DIR" ;; esac
CUDA_ARCHS=${CUDA_ARCHS:-90}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 8)}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
LOG_DIR="$BUILD_DIR/gpu_check"
LIB="$BUILD_DIR/bindings/libtrainsan_ops.so"
GENERATOR=()
command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
T0=$SECONDS

declare -a NAMES=() STATUS=() SECS=() NOTES=()
FAILED=0

record() {  # name status seconds note
  NAMES+=("$1"); STATUS+=("$2"); SECS+=("$3"); NOTES+=("$4")
  [[ "$2" == ok || "$2" == skipped ]] || FAILED=$((FAILED + 1))
}

# run_phase NAME LIMIT_S NOTE COMMAND... : runs COMMAND under `timeout`, output to the console and
# to $LOG_DIR/NAME.log; records ok / FAILED (rc) / TIMEOUT.
run_phase() {
  local name=$1 limit=$2 note=$3
  shift 3
  local left=$((BUDGET - (SECONDS - T0) - 10))
  ((limit > left)) && limit=$left
  echo
  echo "=== gpu_check: $name (limit ${limit}s): $*"
  if ((DRY_RUN)); then
    record "$name" skipped 0 "dry run"
    return 0
  fi
  if ((limit < 5)); then
    record "$name" TIMEOUT 0 "no time left in the ${BUDGET}s budget"
    return 1
  fi
  local start=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  if ((rc == 0)); then
    record "$name" ok "$took" "$note"
  elif ((rc == 124 || rc == 137)); then
    record "$name" TIMEOUT "$took" "killed after ${limit}s; log $LOG_DIR/$name.log"
  else
    record "$name" "FAILED ($rc)" "$took" "log $LOG_DIR/$name.log"
  fi
  return "$rc"
}

skip_phase() {  # name reason
  echo
  echo "=== gpu_check: $1 skipped: $2"
  record "$1" skipped 0 "$2"
}

mkdir -p "$LOG_DIR"

# --- env ----------------------------------------------------------------------------------------
# shellcheck disable=SC2317  # run through `bash -c`
env_report() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  cmake --version | head -n 1
  "$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"cuda available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
         if torch.cuda.is_available() else ""))
EOF
}
export -f env_report
export PY
run_phase env 60 "" bash -c env_report
GPU_VISIBLE=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
((DRY_RUN)) && GPU_VISIBLE=1

# --- gtest --------------------------------------------------------------------------------------
# A throw-away project: find_package(GTest) there decides TRAINSAN_BUILD_TESTS here.
gtest_probe() {
  local dir
  dir=$(mktemp -d)
  cat >"$dir/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.18)
project(gtest_probe CXX)
find_package(GTest)
if(NOT GTest_FOUND)
  message(FATAL_ERROR "GoogleTest not found")
endif()
EOF
  cmake -S "$dir" -B "$dir/build" >/dev/null 2>&1
  local rc=$?
  rm -rf "$dir"
  if ((rc == 0)); then echo "GoogleTest found"; else echo "GoogleTest not found"; fi
  return $rc
}
HAVE_GTEST=OFF
GTEST=${GTEST:-auto}
echo
if ((DRY_RUN)); then
  echo "=== gpu_check: gtest: probe find_package(GTest) in a throw-away CMake project"
  record gtest skipped 0 "dry run"
elif [[ $GTEST == ON ]] || { [[ $GTEST == auto ]] && gtest_probe >"$LOG_DIR/gtest.log" 2>&1; }; then
  HAVE_GTEST=ON
  echo "=== gpu_check: gtest: GoogleTest found, the C++ suites will be built"
  record gtest ok 0 "GoogleTest found: C++ suites built"
else
  echo "=== gpu_check: gtest: GoogleTest not found, the C++ suites will not be built"
  record gtest skipped 0 "GoogleTest not found: C++ suites not built"
fi

# --- configure, build ---------------------------------------------------------------------------
BUILT=0
if run_phase configure 120 "tests=$HAVE_GTEST, CUDA archs $CUDA_ARCHS" \
  cmake -S "$ROOT" -B "$BUILD_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DTRAINSAN_WITH_CUDA=ON -DTRAINSAN_BUILD_TESTS="$HAVE_GTEST" -DTRAINSAN_BUILD_BENCHMARKS=OFF \
  -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS" -DPython3_EXECUTABLE="$(command -v "$PY")"; then
  run_phase build 300 "$JOBS jobs" cmake --build "$BUILD_DIR" -j "$JOBS" && BUILT=1
else
  skip_phase build "configure failed"
fi
((DRY_RUN)) && BUILT=1

# --- tests --------------------------------------------------------------------------------------
gpu_note() { ((GPU_VISIBLE)) && echo "$1" || echo "$1; NO GPU visible: GPU parts skip"; }
if ((!BUILT)); then
  skip_phase ctest-gpu "build failed"
elif [[ $HAVE_GTEST != ON ]] && ((!DRY_RUN)); then
  skip_phase ctest-gpu "no GoogleTest"
else
  run_phase ctest-gpu 120 "$(gpu_note "ctest -L gpu")" \
    ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure --timeout 100
fi

# --- the CUDA every-step tier (issue 23) ---------------------------------------------------------
# Before pytest, so that a short budget measures them first.
if ((!BUILT)); then
  skip_phase dev-stop "build failed"
else
  # A child trains with device_stop=True and a NaN gradient at step 5: it must stop (non-zero
  # exit, the trainsan device_stop message) before that step is applied.
  run_phase dev-stop 60 "$(gpu_note "device_stop=True, NaN gradient at step 5")" \
    env TRAINSAN_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "$ROOT/bench/gpu_step_tier.py" --phase stop
fi

if ((!BUILT)); then
  skip_phase step-tier "build failed"
else
  # Plain vs trainsan.attach at the defaults on a 26M MLP and a 21M transformer (bf16 autocast):
  # step-time ratio, kernels and blocking syncs per steady step (target: 1 trainsan kernel, 0
  # syncs), the pass against torch._foreach_norm over the same gradients.
  run_phase step-tier 150 "$(gpu_note "MLP + transformer, bf16, plain vs attach defaults")" \
    env TRAINSAN_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "$ROOT/bench/gpu_step_tier.py" --phase tier --json "$LOG_DIR/gpu_step_tier.json"
fi

# --- memory at scale (issue 35) -----------------------------------------------------------------
if ((!BUILT)); then
  skip_phase mem-gpu "build failed"
else
  # Six fresh processes (plain, trainsan, trainsan-trace on mlp67m and stack), 600 steps each.
  run_phase mem-gpu 120 "$(gpu_note "CUDA peak above plain (mlp67m), trace bytes/step (stack)")" \
    env TRAINSAN_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "$ROOT/bench/bench_overhead.py" --device cuda --memory --no-timing \
    --models mlp67m,stack --memory-contenders plain,trainsan,trainsan-trace --memory-steps 600 \
    --json "$LOG_DIR/mem_gpu.json"
fi

if ((!BUILT)); then
  skip_phase pytest "build failed"
else
  # Leave the stacks and the two benchmarks 320 s of the budget whatever pytest takes.
  PYTEST_LIMIT=$((BUDGET - (SECONDS - T0) - 10 - 320))
  ((PYTEST_LIMIT > 180)) && PYTEST_LIMIT=180
  run_phase pytest "$PYTEST_LIMIT" "$(gpu_note "tests/python")" \
    env TRAINSAN_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" -m pytest -q -ra -p no:cacheprovider "$ROOT/tests/python"
fi

# --- stacks -------------------------------------------------------------------------------------
if ((!BUILT)); then
  skip_phase stacks-gpu "build failed"
else
  # DDP over single-rank NCCL (bucket views), FSDP2 world size 1, torch.compile inductor on CUDA:
  # clean loops and planted bugs (bench/gpu_stacks.py).
  run_phase stacks-gpu 120 "$(gpu_note "DDP/NCCL, FSDP2, inductor")" \
    env TRAINSAN_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "$ROOT/bench/gpu_stacks.py"
fi

# --- benchmark ----------------------------------------------------------------------------------
if ((!BUILT)); then
  skip_phase gpu-bench "build failed"
else
  run_phase gpu-bench 150 "$(gpu_note "2 GiB bf16 + fp32, 300 tensors")" \
    env TRAINSAN_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "$ROOT/bench/gpu_bench.py" --json "$LOG_DIR/gpu_bench.json"
fi

if ((!BUILT)); then
  skip_phase gpt2-bench "build failed"
else
  # Sanitizer overhead on a GPT-2-small-sized bf16 training step: default (async), sync=True and
  # an audited step, against the plain step (goal: default <= 1.03x).
  run_phase gpt2-bench 140 "$(gpu_note "GPT-2 small, bf16 autocast, AdamW")" \
    env TRAINSAN_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "$ROOT/bench/bench_gpt2_gpu.py" --steps 8 --rounds 3
fi

if ((!BUILT)); then
  skip_phase desync-gpu "build failed"
else
  # rank_desync's cost per step: two processes on the one GPU (gloo default group, DDP), the check
  # on and off, against Megatron-style SHA-1 hashing (bench_overhead.py's contender set desync;
  # goal <= 1%).
  run_phase desync-gpu 90 "$(gpu_note "2 ranks on one GPU, DDP over gloo")" \
    env TRAINSAN_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "$ROOT/bench/bench_overhead.py" --contenders desync --device cuda \
    --models mlp,transformer --steps 20
fi

if ((!BUILT)); then
  skip_phase prec-gpu "build failed"
else
  # Overflow provenance's cost under CUDA fp16 autocast with a GradScaler (bench_overhead.py's
  # contender set precision; the GPT-2-small figure is gpt2-bench's "provenance" lines).
  run_phase prec-gpu 80 "$(gpu_note "fp16 autocast + GradScaler, provenance off/default/every")" \
    env TRAINSAN_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "$ROOT/bench/bench_overhead.py" --contenders precision --device cuda \
    --models mlp,transformer --steps 60
fi

# --- summary ------------------------------------------------------------------------------------
echo
echo "=== gpu_check summary ($((SECONDS - T0))s of ${BUDGET}s; build dir $BUILD_DIR)"
printf '%-10s | %-12s | %6s | %s\n' phase status seconds note
for i in "${!NAMES[@]}"; do
  printf '%-10s | %-12s | %6s | %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${NOTES[$i]}"
done
if [[ -s "$LOG_DIR/gpu-bench.log" ]]; then
  echo
  echo "gpu_bench:"
  grep -E '^(gpu_bench|[a-z0-9]+: |  )' "$LOG_DIR/gpu-bench.log"
fi
if [[ -s "$LOG_DIR/step-tier.log" ]]; then
  echo
  echo "step tier:"
  grep -E '^(step tier|model|mlp|transformer|  \+trainsan|target)' "$LOG_DIR/step-tier.log"
fi
if [[ -s "$LOG_DIR/mem-gpu.log" ]]; then
  echo
  echo "memory (issue 35):"
  grep -E '^(model |mlp67m |stack |  +(plain|import|trainsan)|goal |memory |import )' \
    "$LOG_DIR/mem-gpu.log"
fi
if [[ -s "$LOG_DIR/dev-stop.log" ]]; then
  echo
  echo "device stop:"
  grep -E '^(device stop|  [a-zA-Z])' "$LOG_DIR/dev-stop.log"
fi
if [[ -s "$LOG_DIR/gpt2-bench.log" ]]; then
  echo
  echo "gpt2_bench:"
  grep -E '^(GPT|contender|plain|trainsan|provenance|goal)' "$LOG_DIR/gpt2-bench.log"
fi
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  cp -r "$LOG_DIR" "$OUT/" 2>/dev/null
fi
echo
echo "gpu_check: $FAILED phase(s) failed"
exit "$FAILED"
