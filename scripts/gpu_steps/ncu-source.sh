# STEPS=ncu-source: where inside a kernel the time goes. ncu's SourceCounters (warp-state samples
# per SASS instruction) and WarpStateStats for one launch of each chosen kernel, warm caches, clocks
# untouched; the per-instruction table is exported as CSV (`--page source --print-source sass`) to
# $OUT/ncu_source_<n>.csv, the sections' details and the CSV's header to $OUT/ncu_source.txt.
# NCU_SRC_RUNS: ';'-separated runs, each "REGEX|m3msa arguments" (default: the indexer and the
# attention of one bf16 layer at 1 token / 16K); NCU_SKIP: launches skipped first.
ns_start=$SECONDS
ns_rc=0
ns_ncu=$(command -v ncu || echo "${CUDA_HOME:-/usr/local/cuda}/bin/ncu")
IFS=';' read -ra ns_runs <<<"${NCU_SRC_RUNS:-indexer_kernel|bench layer --tp 1 --cp off --reps 2 --weights bf16 --tokens 1 --q-len 1 --context 16384;sparse_attention|bench layer --tp 1 --cp off --reps 2 --weights bf16 --tokens 1 --q-len 1 --context 16384}"
ns_n=0
for ns_run in "${ns_runs[@]}"; do
  ns_regex=${ns_run%|*}
  ns_cmd=${ns_run##*|}
  ns_rep="$OUT/ncu_source_$ns_n"
  echo "#### $ns_regex :: $ns_cmd" >>"$OUT/ncu_source.txt"
  # shellcheck disable=SC2086  # the command's flags are word-split on purpose
  timeout "${NCU_TIMEOUT:-150}" "$ns_ncu" --clock-control none --cache-control none \
    -k "regex:$ns_regex" --launch-skip "${NCU_SKIP:-8}" --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight -f -o "$ns_rep" \
    "$CLI" $ns_cmd >>"$OUT/ncu_source.txt" 2>&1 || ns_rc=$?
  "$ns_ncu" -i "$ns_rep.ncu-rep" --page details >>"$OUT/ncu_source.txt" 2>&1 || ns_rc=$?
  "$ns_ncu" -i "$ns_rep.ncu-rep" --page source --csv --print-source sass \
    >"$ns_rep.csv" 2>>"$OUT/ncu_source.txt" || ns_rc=$?
  rm -f "$ns_rep.ncu-rep"
  head -n 3 "$ns_rep.csv" >>"$OUT/ncu_source.txt"
  ns_n=$((ns_n + 1))
done
grep -E "^####|Duration|Warp Cycles|Stall|error|ERROR" "$OUT/ncu_source.txt" | head -n 60
step_result "ncu source ($((SECONDS - ns_start)) s)" $ns_rc
