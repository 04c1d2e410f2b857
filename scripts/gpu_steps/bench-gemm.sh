# shellcheck disable=SC2086  # QUICK_FLAG and the *_ARGS are word-split on purpose
# STEPS=bench-gemm: the runtime's skinny projection GEMM against the vendor library. First the
# PyTorch baseline (bench/torch_gemm.py: bf16 F.linear through cuBLAS and cuBLASLt, fp8
# torch._scaled_mm with per-channel weight scales where this torch takes them) to
# $OUT/torch_gemm.json, then `m3msa bench gemm --torch-json` (M3 qkv / o projections at TP 1 and 2
# x rows {1,2,4,8,16} x bf16 / fp8; QUICK=1: rows 1,16) to $OUT/bench_gemm.json; both logs and the
# merged table in $OUT/bench_gemm.log. Both JSONs are rewritten after every configuration, so a
# run stopped by its timeout keeps what it measured. TORCH_GEMM_ARGS / BENCH_GEMM_ARGS add flags;
# TORCH_GEMM_TIMEOUT / BENCH_GEMM_TIMEOUT (s) bound them. A failed torch baseline is recorded and
# leaves the torch columns empty; the bench still runs.
bgm_start=$SECONDS
timeout "${TORCH_GEMM_TIMEOUT:-300}" python3 bench/torch_gemm.py --json "$OUT/torch_gemm.json" \
  $QUICK_FLAG ${TORCH_GEMM_ARGS:-} >"$OUT/bench_gemm.log" 2>&1
bgm_rc=$?
[[ $bgm_rc -eq 124 ]] && note "bench-gemm: torch baseline stopped by TORCH_GEMM_TIMEOUT; torch_gemm.json holds the configurations done"
grep -E "^torch |^torch_gemm.py:|^fp8 |failed|refused|skipped|Error|error" "$OUT/bench_gemm.log" | head -n 20
step_result "torch gemm baseline ($((SECONDS - bgm_start)) s)" $bgm_rc
bgm_start=$SECONDS
echo "==== m3msa bench gemm" >>"$OUT/bench_gemm.log"
timeout "${BENCH_GEMM_TIMEOUT:-300}" "$CLI" bench gemm --json "$OUT/bench_gemm.json" \
  --torch-json "$OUT/torch_gemm.json" --commit "${M3MSA_COMMIT:-unknown}" $QUICK_FLAG \
  ${BENCH_GEMM_ARGS:-} >>"$OUT/bench_gemm.log" 2>&1
bgm_rc=$?
[[ $bgm_rc -eq 124 ]] && note "bench-gemm: stopped by BENCH_GEMM_TIMEOUT; bench_gemm.json holds the configurations done"
sed -n '/^==== m3msa bench gemm/,$p' "$OUT/bench_gemm.log" | grep -E "^\| |^m3msa|^torch baseline|^check|BAD|ERROR|error|skip" | tail -n 60
step_result "bench gemm ($((SECONDS - bgm_start)) s)" $bgm_rc
