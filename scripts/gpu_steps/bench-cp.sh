# STEPS=bench-cp: `m3msa bench cp` (its default grid, or its --quick subset with QUICK=1), JSON to
# $OUT/bench_cp.json (rewritten after every configuration, so a run stopped by BENCH_CP_TIMEOUT
# keeps what it measured; "complete": true when the grid finished), progress and the table to
# $OUT/bench_cp.log. BENCH_CP_ARGS adds flags (e.g. --worlds 2 --batches 32 --contexts 131072).
# On a 1-GPU machine the bench skips P = 2 itself (noted in the log).
cpb_start=$SECONDS
cpb_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[[ $cpb_gpus -lt 2 ]] && note "bench-cp: $cpb_gpus GPU(s) visible: P = 2 skipped"
timeout "${BENCH_CP_TIMEOUT:-560}" "$CLI" bench cp --json "$OUT/bench_cp.json" \
  --commit "${M3MSA_COMMIT:-unknown}" $QUICK_FLAG ${BENCH_CP_ARGS:-} >"$OUT/bench_cp.log" 2>&1
cpb_rc=$?
[[ $cpb_rc -eq 124 ]] && note "bench-cp: stopped by BENCH_CP_TIMEOUT; bench_cp.json holds the configurations done"
grep -E "^\| |ERROR|skip" "$OUT/bench_cp.log" | tail -n 80
step_result "bench cp ($((SECONDS - cpb_start)) s)" $cpb_rc
