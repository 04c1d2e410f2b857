# STEPS=sanitize-all: compute-sanitizer memcheck, racecheck, synccheck and initcheck over the
# whole GPU suite ($TESTS, i.e. build-gpu/tests/m3msa_cuda_tests), one run per tool bounded by
# SANITIZE_TOOL_TIMEOUT, with M3MSA_TEST_SMALL=1 (tests/cuda/indexer_test_util.h caps the drawn
# contexts at 16K tokens; nothing else changes).
#
# Excluded, because the sanitizer cannot run them (SANITIZE_EXCLUDE overrides the list):
#  - tests whose ranks wait on each other's kernels: peer transport with 2 ranks
#    (CudaCp.PeerTwoRanksBitIdentical, PeerTwoRanksSpanScoringBitIdentical,
#    PeerMoreRanksThanHeads, PeerGraphReplayedThousandTimes, SkippedCallTimesOutNamingTheRank,
#    CudaCpFaults.*) and NCCL (CudaCp.Nccl*,
#    CudaCp.AllReduceMax*, RuntimeGpu.TensorParallel2MatchesTp1), the peer all-reduce with 2 or 4
#    ranks (PeerAllReduce.Exact*Ranks*, .ExactTwoGpus, .GraphReplayedTwoHundredTimes,
#    PeerAllReduceFaults.*) and the runtime's TP = 2 on one GPU
#    (RuntimeGpu.TensorParallel2OnOneGpuMatchesTp1, .FaultsOfOneRankAreNamedOnTheOther). The
#    tools serialize kernel
#    launches, so a kernel spinning on a peer's stores waits for a kernel that cannot start until
#    its budget expires: a timeout, not a finding.
#  - CudaCpMultiProcess* (need `m3msa launch -n 2`; they skip without WORLD_SIZE anyway).
#  - device-memory stability checks (MemoryStability.*,
#    RuntimeGpu.DetachPrepareCyclesKeepDeviceMemoryStable): the sanitizer's own device
#    allocations move cudaMemGetInfo; the `memory` and `tests` steps run them unsanitized.
# Still run: every single-GPU test, CudaCp.PeerOneRankMatchesOneGpu, ReplicatedTwoRanks*,
# MismatchedConfigsCaughtAtSetup, LayersShareOneBufferSet (no cross-rank waits).
#
# Output: $OUT/sanitize_all.log (every tool's full output), and per tool one line in the summary:
#   sanitize-all memcheck: 58/58 tests run, 0 failed, 0 sanitizer errors (0 API errors), rc 0 (131 s)
# A tool that hits its timeout says TIMEOUT and which test was running; its error count is then
# the error reports seen so far. Pass: every tool rc 0 (all tests ran and passed, 0 errors).
#   SANITIZE_TOOLS          default "memcheck racecheck synccheck initcheck"
#   SANITIZE_TOOL_TIMEOUT   seconds per tool, default 140 (4 tools fit one 10-minute command)
#   SANITIZE_FILTER         the gtest filter of the tests to run (default "*": the whole suite,
#                           less the exclusions), e.g. "MoeKernel.Small*:CudaIndexerSplit.*"
start=$SECONDS
sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
sanitize_exclude=${SANITIZE_EXCLUDE:-CudaCp.PeerTwoRanksBitIdentical:CudaCp.PeerTwoRanksSpanScoringBitIdentical:CudaCp.PeerMoreRanksThanHeads:CudaCp.PeerGraphReplayedThousandTimes:CudaCp.SkippedCallTimesOutNamingTheRank:CudaCp.Nccl*:CudaCp.AllReduceMax*:CudaCpFaults.*:CudaCpMultiProcess*:RuntimeGpu.TensorParallel2MatchesTp1:RuntimeGpu.TensorParallel2OnOneGpuMatchesTp1:RuntimeGpu.FaultsOfOneRankAreNamedOnTheOther:PeerAllReduce.Exact*:PeerAllReduce.GraphReplayedTwoHundredTimes:PeerAllReduceFaults.*:MemoryStability.*:RuntimeGpu.DetachPrepareCyclesKeepDeviceMemoryStable}
sanitize_filter="${SANITIZE_FILTER:-*}-$sanitize_exclude"
sanitize_total=$("$TESTS" --gtest_list_tests --gtest_filter="$sanitize_filter" 2>/dev/null | grep -c '^  ')
note "sanitize-all: $sanitize_total tests selected; excluded: $sanitize_exclude"
sanitize_rc=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
  tool_start=$SECONDS
  tool_log=$(mktemp)
  M3MSA_TEST_SMALL=1 timeout --kill-after=15 "${SANITIZE_TOOL_TIMEOUT:-140}" "$sanitizer" \
    --tool "$tool" --error-exitcode 9 --print-limit 200 \
    "$TESTS" --gtest_filter="$sanitize_filter" >"$tool_log" 2>&1
  tool_rc=$?
  ran=$(grep -cE '^\[ +(OK|FAILED|SKIPPED) +\] .*\([0-9]+ ms\)' "$tool_log")
  failed_tests=$(grep -cE '^\[  FAILED  \] .*\([0-9]+ ms\)' "$tool_log")
  api_errors=$(grep -c '^========= Program hit' "$tool_log")
  errors=$(sed -n 's/^========= ERROR SUMMARY: \([0-9][0-9]*\) error.*/\1/p' "$tool_log" | tail -n 1)
  line="sanitize-all $tool: $ran/$sanitize_total tests run, $failed_tests failed"
  if [[ -z "$errors" ]]; then
    # No summary: the run was cut off. Count the reports printed so far.
    errors=$(grep -cE '^========= (Invalid|Error|Barrier|Uninitialized|Race|Warning|Program hit|Out-of-range|Misaligned|Malloc|Cuda)' "$tool_log")
    line+=", >= $errors sanitizer reports so far ($api_errors API errors)"
  else
    line+=", $errors sanitizer errors ($api_errors API errors)"
  fi
  line+=", rc $tool_rc ($((SECONDS - tool_start)) s)"
  if [[ $tool_rc -eq 124 || $tool_rc -eq 137 ]]; then
    line+=", TIMEOUT while running: $(grep -E '^\[ RUN' "$tool_log" | tail -n 1 | sed 's/^\[ RUN  *\] //')"
  fi
  note "$line"
  grep -E '^========= (Invalid|Error|Barrier|Uninitialized|Race|Program hit)' "$tool_log" | sort | uniq -c | sort -rn | head -n 5
  { echo "#### compute-sanitizer --tool $tool (rc $tool_rc)"; cat "$tool_log"; } >>"$OUT/sanitize_all.log"
  rm -f "$tool_log"
  [[ $tool_rc -ne 0 ]] && sanitize_rc=$tool_rc
  [[ $failed_tests -gt 0 && $sanitize_rc -eq 0 ]] && sanitize_rc=1
done
step_result "sanitize-all ($((SECONDS - start)) s)" $sanitize_rc
