# STEPS=soak: `m3msa soak --gpu --steps 100000`: the CUDA CP indexer (peer transport, P =
# max(2, GPUs) ranks as threads) vs the one-GPU CUDA backend (bit for bit) vs the CPU reference
# (near-tie rule), randomized decode steps within fixed planned maxima, cudaMemGetInfo sampled on
# every GPU. Writes $OUT/soak.json and $OUT/soak.log. Pass: "passed": true in the JSON, i.e.
# steps == 100000, mismatches == 0, no error, every memory series flat.
#   SOAK_STEPS (100000), SOAK_MAX_SECONDS (540: the soak stops itself and still writes its JSON),
#   SOAK_TIMEOUT (570: the hard kill), SOAK_ARGS (extra flags, e.g. "--ranks 4 --seed 2")
# Run it as a step of its own: it takes most of one 10-minute device command.
start=$SECONDS
soak_steps=${SOAK_STEPS:-100000}
# shellcheck disable=SC2086
timeout "${SOAK_TIMEOUT:-570}" "$CLI" soak --gpu --steps "$soak_steps" \
  --max-seconds "${SOAK_MAX_SECONDS:-540}" --json "$OUT/soak.json" ${SOAK_ARGS:-} \
  >"$OUT/soak.log" 2>&1
rc=$?
grep -v "^soak --gpu step" "$OUT/soak.log" | tail -n 20
step_result "soak --gpu --steps $soak_steps ($((SECONDS - start)) s)" $rc
