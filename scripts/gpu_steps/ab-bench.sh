# shellcheck disable=SC2086  # the *_ARGS are word-split on purpose
# STEPS=ab-bench: a change against the code before it, in one call on one card. The CLIs named in
# AB_CLIS (default "m3msa-base m3msa": binaries under $BUILD/cli, e.g. m3msa-base built from the
# parent commit) run the same benches one after the other, alternating AB_ROUNDS (default 2)
# times, so drift of the machine shows as a difference between rounds. AB_GEMM_ARGS,
# AB_LAYER_ARGS, AB_INDEXER_ARGS, AB_ATTENTION_ARGS, AB_MOE_ARGS: the flags of `bench gemm` /
# `layer` / `indexer` / `attention` / `moe` (empty: that bench is left out). Logs and JSON under
# $OUT/ab/; scripts/bench_compare.py --base $OUT/ab/indexer_m3msa-base_*.json --new
# $OUT/ab/indexer_m3msa_*.json compares them.
ab_start=$SECONDS
ab_rc=0
mkdir -p "$OUT/ab"
for ab_round in $(seq 1 "${AB_ROUNDS:-2}"); do
  for ab_side in ${AB_CLIS:-m3msa-base m3msa}; do
    for ab_bench in gemm layer indexer attention moe; do
      ab_var="AB_${ab_bench^^}_ARGS"
      ab_args=${!ab_var:-}
      [[ -z "$ab_args" ]] && continue
      ab_file="$OUT/ab/${ab_bench}_${ab_side}_$ab_round"
      timeout "${AB_TIMEOUT:-200}" "$BUILD/cli/$ab_side" bench "$ab_bench" --json "$ab_file.json" \
        $ab_args >"$ab_file.log" 2>&1 || ab_rc=$?
      echo "== $ab_bench $ab_side round $ab_round"
      grep -E "^\| " "$ab_file.log" | tail -n 40
    done
  done
done
step_result "a/b bench ($((SECONDS - ab_start)) s)" $ab_rc
