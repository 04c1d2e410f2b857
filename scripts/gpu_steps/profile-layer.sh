# STEPS=profile-layer: where one sparse layer's time goes. ncu (clocks left alone, caches flushed
# before every kernel; PROFILE_LAYER_CACHE=none keeps them, so each kernel finds what the previous
# ones left in L2, as under replay) times each kernel of `m3msa bench layer` for each configuration of
# PROFILE_LAYER_CONFIGS (';'-separated flag sets, one configuration each), and the per-kernel
# averages go to $OUT/profile_layer.txt. The sum of the kernels against the bench's graph-replay
# median is the time between kernels (launch, ramp and drain), which no single kernel shows.
pl_start=$SECONDS
pl_rc=0
pl_ncu=$(command -v ncu || echo "${CUDA_HOME:-/usr/local/cuda}/bin/ncu")
IFS=';' read -ra pl_configs <<<"${PROFILE_LAYER_CONFIGS:---weights bf16 --tokens 1 --q-len 1 --context 16384;--weights bf16 --tokens 1 --q-len 1 --context 131072}"
for pl_cfg in "${pl_configs[@]}"; do
  echo "#### bench layer --tp 1 --cp off --reps 2 $pl_cfg" >>"$OUT/profile_layer.txt"
  # shellcheck disable=SC2086  # the configuration's flags are word-split on purpose
  timeout "${PROFILE_LAYER_TIMEOUT:-150}" "$pl_ncu" --clock-control none \
    --cache-control "${PROFILE_LAYER_CACHE:-all}" --print-summary per-kernel \
    --metrics gpu__time_duration.sum "$CLI" bench layer --tp 1 --cp off --reps 2 $pl_cfg \
    >>"$OUT/profile_layer.txt" 2>&1 || pl_rc=$?
done
grep -E "^####|^  [a-z_:<>0-9A-Z]+.*\(|gpu__time_duration|^\| " "$OUT/profile_layer.txt" | head -n 80
step_result "profile layer ($((SECONDS - pl_start)) s)" $pl_rc
