# STEPS=moe: the mixture of experts on the GPU, log in $OUT/moe.log:
#  - MoeKernel.*, DenseMlpKernel.*  the moe family vs cpu::moe / cpu::dense_mlp (small shapes and
#                     M3's rank shapes, 1..16 rows, bf16 and MXFP8; tensor-core, FMA and PDL
#                     kernels), graph replay == eager, run to run;
#  - MoeRuntimeGpu.*, DenseLayersRuntimeGpu.*  forward_layer with experts / dense layers vs the
#                     CPU runtime, StepGraphs replay == eager;
# then `bench moe` (the MoE and the dense MLP alone: TP 1 / 4 / 8 rank shapes, tokens 1, 4, 16,
# bf16 and MXFP8, kernels mma, fma, mma+pdl, mma-deep, mma-down4, mma-persistent; JSON to
# $OUT/bench_moe.json) and
# `bench layer --moe bf16,mxfp8 --rank-of 1,4,8 --layer-kind sparse,dense` (tokens 1, 4, 16,
# q_len 1, 16K context, TP 1) once per runtime MoE schedule in MOE_LAYER_SCHEDULES (default
# "launches persistent"; JSON to $OUT/bench_layer_moe_<schedule>.json). MOE_TEST_TIMEOUT /
# MOE_BENCH_TIMEOUT bound them (s); MOE_BENCH_ARGS adds flags to bench layer, MOE_ALONE_ARGS
# replaces bench moe's.
moe_start=$SECONDS
timeout "${MOE_TEST_TIMEOUT:-400}" "$TESTS" \
  --gtest_filter="MoeKernel.*:DenseMlpKernel.*:MoeRuntimeGpu.*:DenseLayersRuntimeGpu.*" \
  >"$OUT/moe.log" 2>&1
moe_rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|^\[==========\]|Failure|\[ info \]|Expected|Which is" \
  "$OUT/moe.log" | tail -n 60
if [[ $moe_rc -eq 0 ]]; then
  # shellcheck disable=SC2086  # the *_ARGS are word-split on purpose
  timeout "${MOE_BENCH_TIMEOUT:-400}" "$CLI" bench moe \
    ${MOE_ALONE_ARGS:---kernels mma,fma,mma+pdl,mma-deep,mma-down4,mma-persistent --reps 20} \
    --json "$OUT/bench_moe.json" --commit "${M3MSA_COMMIT:-unknown}" >>"$OUT/moe.log" 2>&1
  moe_rc=$?
  # One bench layer run per MoE schedule of the runtime (M3MSA_MOE_SCHEDULE).
  for moe_schedule in ${MOE_LAYER_SCHEDULES:-launches persistent}; do
    # shellcheck disable=SC2086
    M3MSA_MOE_SCHEDULE=$moe_schedule timeout "${MOE_BENCH_TIMEOUT:-400}" "$CLI" bench layer \
      --moe bf16,mxfp8 --rank-of 1,4,8 --layer-kind sparse,dense --tp 1 --cp off --weights fp8 \
      --q-len 1 --tokens 1,4,16 --context 16384 --layers 2 \
      --json "$OUT/bench_layer_moe_$moe_schedule.json" --commit "${M3MSA_COMMIT:-unknown}" \
      ${MOE_BENCH_ARGS:-} >>"$OUT/moe.log" 2>&1
    layer_rc=$?
    [[ $moe_rc -eq 0 ]] && moe_rc=$layer_rc
  done
  grep -E "^\| |ERROR|error" "$OUT/moe.log" | tail -n 60
fi
step_result "moe ($((SECONDS - moe_start)) s)" $moe_rc
