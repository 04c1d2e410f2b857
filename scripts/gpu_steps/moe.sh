# STEPS=moe: the mixture of experts on the GPU, log in $OUT/moe.log:
#  - MoeKernel.*      the moe family vs cpu::moe (small shapes and M3's TP 4 / TP 8 rank shapes,
#                     1..16 rows, bf16 and MXFP8), graph replay == eager, run to run;
#  - MoeRuntimeGpu.*  forward_layer with experts vs the CPU runtime, StepGraphs replay == eager;
# then `bench layer --moe bf16,mxfp8 --rank-of 1,4,8` (tokens 1, 4, 16, q_len 1, 16K context,
# TP 1), JSON to $OUT/bench_layer_moe.json. MOE_TEST_TIMEOUT / MOE_BENCH_TIMEOUT bound them (s);
# MOE_BENCH_ARGS adds flags.
moe_start=$SECONDS
timeout "${MOE_TEST_TIMEOUT:-400}" "$TESTS" --gtest_filter="MoeKernel.*:MoeRuntimeGpu.*" \
  >"$OUT/moe.log" 2>&1
moe_rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|^\[==========\]|Failure|\[ info \]|Expected|Which is" \
  "$OUT/moe.log" | tail -n 60
if [[ $moe_rc -eq 0 ]]; then
  timeout "${MOE_BENCH_TIMEOUT:-400}" "$CLI" bench layer --moe bf16,mxfp8 --rank-of 1,4,8 \
    --tp 1 --cp off --weights fp8 --q-len 1 --tokens 1,4,16 --context 16384 --layers 2 \
    --json "$OUT/bench_layer_moe.json" --commit "${M3MSA_COMMIT:-unknown}" ${MOE_BENCH_ARGS:-} \
    >>"$OUT/moe.log" 2>&1
  moe_rc=$?
  grep -E "^\| |ERROR|error" "$OUT/moe.log" | tail -n 30
fi
step_result "moe ($((SECONDS - moe_start)) s)" $moe_rc
