# STEPS=allreduce: the one-shot peer all-reduce (src/comm/peer_allreduce.h) on the GPU machine.
#  1. its tests (PeerAllReduce.* and PeerAllReduceFaults.*: exactness at P = 2 and 4 on one GPU,
#     P = 2 on two, graph replays, faults), under `timeout`      -> $OUT/allreduce_tests.log
#  2. `m3msa bench allreduce` (rows 1..16 x 6144 fp32, TP 2: one-shot vs NCCL with 2 GPUs,
#     one-shot on one GPU otherwise), table in $OUT/bench_allreduce.log, JSON in
#     $OUT/bench_allreduce.json. BENCH_AR_ARGS adds flags (e.g. --ctas 64 --launches 50).
ar_start=$SECONDS
ar_rc=0
timeout "${AR_TEST_TIMEOUT:-300}" "$TESTS" --gtest_filter='PeerAllReduce*' \
  >"$OUT/allreduce_tests.log" 2>&1 || ar_rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|^\[==========\]|Failure|timeout after|CTAs per|rank [01] after" \
  "$OUT/allreduce_tests.log" | tail -n 40
[[ $ar_rc -ne 0 ]] && note "allreduce: tests rc $ar_rc (124 = timeout)"
arb_rc=0
timeout "${BENCH_AR_TIMEOUT:-300}" "$CLI" bench allreduce --json "$OUT/bench_allreduce.json" \
  --commit "${M3MSA_COMMIT:-unknown}" ${BENCH_AR_ARGS:-} >"$OUT/bench_allreduce.log" 2>&1 || arb_rc=$?
grep -E "^m3msa bench|^  |^\| |^one-shot|error|WRONG" "$OUT/bench_allreduce.log" | tail -n 30
[[ $arb_rc -ne 0 ]] && note "allreduce: bench rc $arb_rc (1 = a wrong result, 124 = timeout)"
[[ $arb_rc -ne 0 ]] && ar_rc=$arb_rc
step_result "allreduce tests + bench ($((SECONDS - ar_start)) s)" $ar_rc
