# STEPS=ncu-kernels: Nsight Compute sections (speed of light, memory, scheduler, warp stalls,
# occupancy, launch) and the stall reasons per issued instruction of chosen kernels, warm caches,
# clocks untouched. NCU_RUNS: ';'-separated runs, each "REGEX|m3msa arguments" (default: the
# attention and the indexer of one bf16 layer at 1 token / 16K); NCU_SKIP / NCU_COUNT: launches
# skipped / profiled per run; NCU_METRICS: the metrics read beside the sections (default: the stall
# reasons; e.g. "sm__cycles_active.max,sm__cycles_active.avg" shows a kernel's tail on few SMs).
# Text to $OUT/ncu_kernels.txt.
nk_start=$SECONDS
nk_rc=0
nk_ncu=$(command -v ncu || echo "${CUDA_HOME:-/usr/local/cuda}/bin/ncu")
IFS=';' read -ra nk_runs <<<"${NCU_RUNS:-sparse_attention|indexer_kernel|bench layer --tp 1 --cp off --reps 2 --weights bf16 --tokens 1 --q-len 1 --context 16384}"
for nk_run in "${nk_runs[@]}"; do
  nk_regex=${nk_run%|*}
  nk_cmd=${nk_run##*|}
  echo "#### $nk_regex :: $nk_cmd" >>"$OUT/ncu_kernels.txt"
  # shellcheck disable=SC2086  # the command's flags are word-split on purpose
  timeout "${NCU_TIMEOUT:-150}" "$nk_ncu" --clock-control none --cache-control none \
    -k "regex:$nk_regex" --launch-skip "${NCU_SKIP:-8}" --launch-count "${NCU_COUNT:-4}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    --metrics "${NCU_METRICS:-regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio}" \
    "$CLI" $nk_cmd >>"$OUT/ncu_kernels.txt" 2>&1 || nk_rc=$?
done
grep -E "^####|^  [a-zA-Z_:<>0-9 ,]+\(|Duration|Warp Cycles|Eligible|Achieved Occupancy|DRAM Throughput|L2 Hit" \
  "$OUT/ncu_kernels.txt" | head -n 80
step_result "ncu kernels ($((SECONDS - nk_start)) s)" $nk_rc
