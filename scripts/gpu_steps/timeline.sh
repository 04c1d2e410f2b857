# STEPS=timeline: where the latency chains of one request spend their time. Each bench runs its
# timed configurations and then one more launch with the kernels' stage stamps recorded
# (`--timeline`, bench/timeline.h): the attention at one request (default tuning and 16 splits),
# the indexer at one request (both merge placements), the sparse step (indexer then attention on
# one clock; the attention also with pdl and with its selection-only wait, early=1) and the
# persistent MoE of a TP 4 rank at one token. TIMELINE_RUNS overrides the list: '|'-separated m3msa
# arguments. Logs to $OUT/timeline_<n>.log, JSON to $OUT/timeline_<n>.json.
tl_start=$SECONDS
tl_rc=0
IFS='|' read -ra tl_runs <<<"${TIMELINE_RUNS:-bench attention --batch 1 --q-len 1,4 --context 131072 --kv bf16,fp8 --tunings default;splits=16 --reps 10 --timeline|bench indexer --batches 1 --contexts 4096,131072 --q-lens 1,4 --dtypes bf16 --no-unfused --split-merge --reps 10 --timeline|bench sparse-step --batches 1 --contexts 131072 --q-lens 1 --dtypes bf16,fp8 --attention-tunings default;pdl=1;pdl=1,early=1 --reps 10 --timeline|bench moe --tp 4 --tokens 1,4 --dtypes mxfp8 --kernels mma-persistent --what moe --reps 5 --timeline}"
tl_n=0
for tl_run in "${tl_runs[@]}"; do
  tl_n=$((tl_n + 1))
  echo "== timeline $tl_n: $tl_run"
  # shellcheck disable=SC2086  # the run's flags are word-split on purpose
  timeout "${TIMELINE_TIMEOUT:-150}" "$CLI" $tl_run --json "$OUT/timeline_$tl_n.json" \
    >"$OUT/timeline_$tl_n.log" 2>&1 || tl_rc=$?
  grep -E "^timeline:|^\| " "$OUT/timeline_$tl_n.log" | head -n 120
done
step_result "timeline ($((SECONDS - tl_start)) s)" $tl_rc
