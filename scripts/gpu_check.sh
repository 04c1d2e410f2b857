#!/usr/bin/env bash
# The one script that runs on the GPU machine: GPU tests, sanitizers and benchmarks of binaries
# built elsewhere (build-gpu/, sm_90a, static cudart and GoogleTest), logs and JSON under $OUT.
#
#   STEPS            comma list of: tests, sanitize, torch-indexer, bench-indexer,
#                    profile-indexer (ncu, PROFILE_CONFIGS), bench-attention,
#                    attention-tunings, sanitize-attention
#                    (default: tests,torch-indexer,bench-indexer)
#   GPU_TEST_FILTER  gtest filter for `tests` (default: all)
#   SANITIZE_FILTER  gtest filter for `sanitize` (default: the fast indexer tests)
#   QUICK=1          the benchmarks' --quick subsets
#   BENCH_ARGS / TORCH_ARGS / ATTN_ARGS  extra flags for the respective step
#   M3MSA_COMMIT     commit id recorded in the benchmark JSON
#   BUILD            build folder (default build-gpu)
#
# Files under $OUT (at most 8 come back from the device tool): summary.txt, gpu_tests.log,
# gpu_tests.json, sanitize.log, torch_indexer.json, bench_indexer.log, bench_indexer.json,
# ncu_indexer.txt, bench_attention.json (keep a run's steps to 8 files). Exit status: non-zero when any step failed.
set -uo pipefail

OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Ranks as threads on one GPU spin on each other's kernels: give their streams hardware queues of
# their own and load every module up front (tests/cuda/test_environment.cc says why).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}
export PYTHONUNBUFFERED=1
BUILD=${BUILD:-build-gpu}
TESTS="$BUILD/tests/m3msa_cuda_tests"
CLI="$BUILD/cli/m3msa"
STEPS=${STEPS:-tests,torch-indexer,bench-indexer}
QUICK_FLAG=""
[[ "${QUICK:-0}" == 1 ]] && QUICK_FLAG="--quick"
SUMMARY="$OUT/summary.txt"
failed=0

has() { [[ ",$STEPS," == *",$1,"* ]]; }
note() { echo "== $*" | tee -a "$SUMMARY"; }
step_result() {  # name rc
  if [[ $2 -eq 0 ]]; then note "$1: ok"; else note "$1: FAILED (rc $2)"; failed=1; fi
}

note "gpu_check $(date -u +'%Y-%m-%d %H:%M UTC') steps=$STEPS commit=${M3MSA_COMMIT:-unknown}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total,memory.used \
  --format=csv 2>&1 | tee -a "$SUMMARY"

if has tests; then
  start=$SECONDS
  timeout "${TEST_TIMEOUT:-300}" "$TESTS" --gtest_filter="${GPU_TEST_FILTER:-*}" \
    --gtest_output="json:$OUT/gpu_tests.json" >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[       OK|^\[  FAILED|^\[==========\]|Failure|near-tie" \
    "$OUT/gpu_tests.log" | tail -n 80
  step_result "tests ($((SECONDS - start)) s)" $rc
fi

if has sanitize; then
  start=$SECONDS
  filter=${SANITIZE_FILTER:-CudaIndexerBlocks.*:CudaIndexer.OneVisible*:CudaIndexer.AllPadding*:CudaIndexer.TwoRuns*}
  rc=0
  sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
  for tool in memcheck racecheck; do
    timeout "${SANITIZE_TIMEOUT:-240}" "$sanitizer" --tool "$tool" --error-exitcode 9 \
      "$TESTS" --gtest_filter="$filter" >>"$OUT/sanitize.log" 2>&1 || rc=$?
    tail -n 3 "$OUT/sanitize.log"
  done
  step_result "sanitize memcheck+racecheck ($((SECONDS - start)) s)" $rc
fi

if has torch-indexer; then
  start=$SECONDS
  timeout "${TORCH_TIMEOUT:-240}" python3 bench/torch_indexer.py --json "$OUT/torch_indexer.json" \
    $QUICK_FLAG ${TORCH_ARGS:-} >>"$OUT/bench_indexer.log" 2>&1
  step_result "torch indexer baseline ($((SECONDS - start)) s)" $?
fi

if has bench-indexer; then
  start=$SECONDS
  timeout "${BENCH_TIMEOUT:-300}" "$CLI" bench indexer --json "$OUT/bench_indexer.json" \
    --torch-json "$OUT/torch_indexer.json" --commit "${M3MSA_COMMIT:-unknown}" \
    $QUICK_FLAG ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench_indexer.log" | grep -v "^batch "
  step_result "bench indexer ($((SECONDS - start)) s)" "${PIPESTATUS[0]}"
fi

if has profile-indexer; then
  # ncu on one fused launch per configuration (PROFILE_CONFIGS: ';'-separated bench flag sets).
  start=$SECONDS
  ncu_bin=$(command -v ncu || echo "${CUDA_HOME:-/usr/local/cuda}/bin/ncu")
  IFS=';' read -ra configs <<<"${PROFILE_CONFIGS:---batches 1 --contexts 1048576 --dtypes bf16 --q-lens 1}"
  rc=0
  for cfg in "${configs[@]}"; do
    echo "#### $cfg" >>"$OUT/ncu_indexer.txt"
    timeout "${PROFILE_TIMEOUT:-120}" "$ncu_bin" --clock-control none \
      --kernel-name regex:indexer_kernel --launch-count 1 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      "$CLI" bench indexer --no-unfused --reps 3 $cfg >>"$OUT/ncu_indexer.txt" 2>&1 || rc=$?
  done
  grep -E "^####|Duration|DRAM Throughput|Memory Throughput|L2 Hit|Achieved Occupancy|Stall" \
    "$OUT/ncu_indexer.txt" | head -n 60
  step_result "profile indexer ($((SECONDS - start)) s)" $rc
fi

if has bench-attention; then
  start=$SECONDS
  timeout "${BENCH_TIMEOUT:-300}" "$CLI" bench attention --json "$OUT/bench_attention.json" \
    $QUICK_FLAG ${ATTN_ARGS:-} 2>&1 | tail -n 60
  step_result "bench attention ($((SECONDS - start)) s)" "${PIPESTATUS[0]}"
fi

# ---- sparse attention + preprocessing ----
# attention-tunings: the attention and preprocessing suites again under every launcher tuning the
# benchmark compares (AttentionTuning, src/cuda/attention.h; the default one already ran in
# `tests`).
if has attention-tunings; then
  start=$SECONDS
  rc=0
  for tuning in ${ATTN_TUNINGS:-cluster=0,pdl=0 cluster=0,pdl=1 cluster=2,pdl=1}; do
    M3MSA_TEST_ATTENTION_TUNING=$tuning timeout "${TEST_TIMEOUT:-300}" "$TESTS" \
      --gtest_filter='CudaSparseAttention.*' >>"$OUT/attention_tunings.log" 2>&1 || rc=$?
    grep -E "tuning under test|^\[  (PASSED|FAILED) " "$OUT/attention_tunings.log" | tail -n 2
  done
  step_result "attention tests under tunings ($((SECONDS - start)) s)" $rc
fi
# sanitize-attention: memcheck and racecheck over the small attention / preprocessing tests.
if has sanitize-attention; then
  start=$SECONDS
  rc=0
  sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
  filter=${ATTN_SANITIZE_FILTER:-CudaSparseAttention.RowsWithoutKeys*:CudaSparseAttention.SmallGroup*:CudaSparseAttention.Prefill*:CudaPreprocess.*}
  for tool in memcheck racecheck; do
    timeout "${SANITIZE_TIMEOUT:-240}" "$sanitizer" --tool "$tool" --error-exitcode 9 \
      "$TESTS" --gtest_filter="$filter" >>"$OUT/sanitize_attention.log" 2>&1 || rc=$?
    tail -n 3 "$OUT/sanitize_attention.log"
  done
  step_result "sanitize attention memcheck+racecheck ($((SECONDS - start)) s)" $rc
fi

# Step files: scripts/gpu_steps/<name>.sh, each run when <name> is in STEPS. They see OUT, BUILD,
# TESTS, CLI, QUICK_FLAG and the helpers has / note / step_result, and record their own result.
for step_file in "$(dirname "$0")"/gpu_steps/*.sh; do
  [[ -e "$step_file" ]] || continue
  step_name=$(basename "$step_file" .sh)
  if has "$step_name"; then
    # shellcheck source=/dev/null
    source "$step_file"
  fi
done

exit $failed
