# STEPS=runtime-tests: the CUDA runtime tests (tests/cuda/runtime_gpu_test.cc), under
# `timeout`, log in $OUT/runtime_tests.log:
#  - RuntimeKernels.*  skinny GEMM vs a double reference, add + RMSNorm vs the CPU;
#  - RuntimeGpu.*      forward_layer vs the CPU runtime (bf16, fp8, device metadata), StepGraphs
#                      replay == eager bit-for-bit, prepare / begin_step refused while capturing,
#                      fallbacks, 1000 detach/prepare cycles with stable device memory, and
#                      TensorParallel2MatchesTp1 (ranks as threads on 2 GPUs over NCCL).
# On a 1-GPU machine the TP = 2 test skips itself (noted here). Pass: exit 0, no "[  FAILED  ]".
# RUNTIME_TEST_FILTER overrides the gtest filter; RUNTIME_TEST_TIMEOUT bounds the run (s).
rtt_start=$SECONDS
rtt_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[[ $rtt_gpus -lt 2 ]] && note "runtime-tests: $rtt_gpus GPU(s) visible: TensorParallel2MatchesTp1 skips (needs 2)"
timeout "${RUNTIME_TEST_TIMEOUT:-400}" "$TESTS" \
  --gtest_filter="${RUNTIME_TEST_FILTER:-RuntimeKernels.*:RuntimeGpu.*}" \
  >"$OUT/runtime_tests.log" 2>&1
rtt_rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[       OK|^\[  FAILED|^\[==========\]|Failure|\[ info \]|Expected|Which is|got " \
  "$OUT/runtime_tests.log" | tail -n 80
step_result "runtime-tests ($((SECONDS - rtt_start)) s)" $rtt_rc
