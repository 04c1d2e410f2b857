# STEPS=bench-layer: `m3msa bench layer` (its default grid: TP {1,2} x weights {bf16,fp8} x tokens
# {1,4,16} x q_len {1,4} x context {16K,128K}; QUICK=1: its --quick subset), JSON to
# $OUT/bench_layer.json (rewritten after every configuration, so a run stopped by
# BENCH_LAYER_TIMEOUT keeps what it measured), progress and the table to $OUT/bench_layer.log.
# BENCH_LAYER_ARGS adds flags (e.g. --tp 1 --weights fp8 --layers 8). On a 1-GPU machine the
# bench skips TP = 2 itself (noted in the log). LAYER_EXTRA_ARGS (e.g. "--quick --share-period 2"):
# the bench once more with these flags, JSON to $OUT/bench_layer_extra.json, table appended to
# the log.
blb_start=$SECONDS
blb_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[[ $blb_gpus -lt 2 ]] && note "bench-layer: $blb_gpus GPU(s) visible: TP = 2 skipped"
timeout "${BENCH_LAYER_TIMEOUT:-540}" "$CLI" bench layer --json "$OUT/bench_layer.json" \
  --commit "${M3MSA_COMMIT:-unknown}" $QUICK_FLAG ${BENCH_LAYER_ARGS:-} >"$OUT/bench_layer.log" 2>&1
blb_rc=$?
[[ $blb_rc -eq 124 ]] && note "bench-layer: stopped by BENCH_LAYER_TIMEOUT; bench_layer.json holds the configurations done"
grep -E "^\| |ERROR|error|skipped|not measured" "$OUT/bench_layer.log" | tail -n 70
if [[ -n "${LAYER_EXTRA_ARGS:-}" ]]; then
  echo "==== bench layer $LAYER_EXTRA_ARGS" >>"$OUT/bench_layer.log"
  # shellcheck disable=SC2086
  timeout "${BENCH_LAYER_TIMEOUT:-540}" "$CLI" bench layer --json "$OUT/bench_layer_extra.json" \
    --commit "${M3MSA_COMMIT:-unknown}" $LAYER_EXTRA_ARGS >>"$OUT/bench_layer.log" 2>&1 || blb_rc=$?
  sed -n '/^==== bench layer/,$p' "$OUT/bench_layer.log" | grep -E "^\| " | tail -n 30
fi
step_result "bench layer ($((SECONDS - blb_start)) s)" $blb_rc
