# STEPS=memory: 1000 plan / run / destroy cycles of the CUDA backend and of the CUDA CP
# indexer (2 ranks when 2 GPUs are visible, else 1); cudaMemGetInfo free memory after every
# sampled cycle within 2 MiB of its value after the first cycle
# (tests/cuda/memory_stability_test.cc). Writes $OUT/memory.log. Pass: both tests OK; the log's
# "[...] device N: ... drop X MiB" lines give the numbers.
start=$SECONDS
timeout "${MEMORY_TIMEOUT:-300}" "$TESTS" --gtest_filter='MemoryStability.*' \
  >"$OUT/memory.log" 2>&1
rc=$?
grep -E "^\[ +(OK|FAILED|SKIPPED|PASSED) |^\[==========\]|device [0-9]+: free|CP indexer cycles|Failure" \
  "$OUT/memory.log" | tail -n 20
step_result "memory stability, 1000 cycles ($((SECONDS - start)) s)" $rc
