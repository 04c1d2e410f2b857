# shellcheck disable=SC2086  # the *_ARGS are word-split on purpose
# STEPS=bench-results: the benchmarks behind the tables of docs/benchmarks.md, each with --json,
# packed as $OUT/bench_results.tgz (<benchmark>.json and <benchmark>.log for each; unpack the JSON
# into bench/results/) with the printed tables in $OUT/bench_results.txt: two files, whatever the
# number of benchmarks. Every bench rewrites its JSON after each configuration, so one stopped by
# its time limit keeps the rows it measured ("complete": false). On one H200 the single-GPU list
# takes 1-2 minutes (indexer 6 s, attention 9 s, moe 38 s); the time limits below are generous.
# BENCH_RESULTS_ONLY picks a subset.
#   indexer, attention, sparse-step  batch {1,4,32,128} x context {4K,32K,128K} x q_len {1,2,4} x
#                                    {bf16,fp8}, 20 replays (the indexer: also an fp8 index_q and
#                                    both merge placements; attention: its default tunings)
#   attention-own                    attention with each row's own selection (--row-share 0),
#                                    q_len {2,4}
#   indexer-long, attention-long,    the same benchmarks at batch {1,4} x context {512K,1M}
#   sparse-step-long                 (<name>-long.json)
#   layer                            TP 1 (and 2 with 2 GPUs), CP off, tokens {1,4,16} x q_len
#                                    {1,4} x context {16K,128K} x weights {bf16,fp8}
#   gemm                             M3's four projection shapes x rows {1,2,4,8,16} x {bf16,fp8}
#   moe                              {MoE, dense MLP} x TP {1,4,8} rank shapes x tokens {1,4,16} x
#                                    {bf16,mxfp8} x kernels {mma,fma,mma+pdl,mma-deep,mma-down4,
#                                    mma-persistent}
#   cp, allreduce                    only with 2 GPUs visible (P = 2 / TP = 2 over NVLink)
# BENCH_RESULTS_ONLY (comma list, default all of the above) picks benchmarks;
# BENCH_RESULTS_<NAME>_ARGS (NAME upper case, '-' as '_', e.g. BENCH_RESULTS_SPARSE_STEP_ARGS)
# replaces a benchmark's flags; BENCH_RESULTS_<NAME>_TIMEOUT its time limit (s).
# The envelope's commit comes from M3MSA_COMMIT.
brs_start=$SECONDS
brs_rc=0
brs_dir="$OUT/bench_results"
mkdir -p "$brs_dir"
brs_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
brs_grid="1,4,32,128"
brs_ctx="4096,32768,131072"
brs_long="524288,1048576"  # batch 1-4 only; <name>-long runs bench <name> and writes <name>-long.json
declare -A brs_args=(
  [indexer]="--batches $brs_grid --contexts $brs_ctx --q-lens 1,2,4 --dtypes bf16,fp8 --q-dtypes bf16,fp8 --split-merge --no-unfused --reps 20"
  [attention]="--batch $brs_grid --context $brs_ctx --q-len 1,2,4 --kv bf16,fp8 --reps 20"
  [attention-own]="--batch $brs_grid --context $brs_ctx --q-len 2,4 --kv bf16,fp8 --row-share 0 --reps 20"
  [sparse-step]="--batches $brs_grid --contexts $brs_ctx --q-lens 1,2,4 --dtypes bf16,fp8 --reps 20"
  [indexer-long]="--batches 1,4 --contexts $brs_long --q-lens 1,2,4 --dtypes bf16,fp8 --q-dtypes bf16,fp8 --split-merge --no-unfused --reps 20"
  [attention-long]="--batch 1,4 --context $brs_long --q-len 1,2,4 --kv bf16,fp8 --reps 20"
  [sparse-step-long]="--batches 1,4 --contexts $brs_long --q-lens 1,2,4 --dtypes bf16,fp8 --reps 20"
  [layer]="--tp 1 --cp off --tokens 1,4,16 --q-len 1,4 --context 16384,131072 --weights bf16,fp8 --reps 20"
  [gemm]="--reps 30"
  [moe]="--tp 1,4,8 --tokens 1,4,16 --dtypes bf16,mxfp8 --kernels mma,fma,mma+pdl,mma-deep,mma-down4,mma-persistent --what moe,dense --reps 20"
  [cp]="--worlds 2 --batches 1,4,32 --contexts $brs_ctx --dtypes fp8 --q-lens 1 --reps 20"
  [allreduce]="--tp 2"
)
declare -A brs_timeout=([indexer]=110 [attention]=70 [attention-own]=60 [sparse-step]=110 [indexer-long]=60
  [attention-long]=45 [sparse-step-long]=60 [layer]=75 [gemm]=30 [moe]=330 [cp]=60 [allreduce]=30)
[[ $brs_gpus -ge 2 ]] && brs_args[layer]=${brs_args[layer]/--tp 1/--tp 1,2}
IFS=',' read -ra brs_list <<<"${BENCH_RESULTS_ONLY:-indexer,attention,attention-own,sparse-step,indexer-long,attention-long,sparse-step-long,layer,gemm,moe,cp,allreduce}"
: >"$OUT/bench_results.txt"
for brs_name in "${brs_list[@]}"; do
  if [[ -z "${brs_args[$brs_name]+set}" ]]; then
    note "bench-results: unknown benchmark '$brs_name' in BENCH_RESULTS_ONLY"
    brs_rc=2
    continue
  fi
  if [[ ($brs_name == cp || $brs_name == allreduce) && $brs_gpus -lt 2 ]]; then
    note "bench-results: $brs_name skipped: $brs_gpus GPU(s) visible, its table needs 2"
    continue
  fi
  brs_var=${brs_name^^}
  brs_var=${brs_var//-/_}
  brs_args_var="BENCH_RESULTS_${brs_var}_ARGS"
  brs_timeout_var="BENCH_RESULTS_${brs_var}_TIMEOUT"
  brs_flags=${!brs_args_var:-${brs_args[$brs_name]}}
  brs_t=$SECONDS
  brs_bench=${brs_name%-long}
  brs_bench=${brs_bench%-own}
  timeout "${!brs_timeout_var:-${brs_timeout[$brs_name]}}" "$CLI" bench "$brs_bench" \
    --json "$brs_dir/$brs_name.json" $brs_flags >"$brs_dir/$brs_name.log" 2>&1
  brs_one=$?
  [[ $brs_one -eq 124 ]] && note "bench-results: $brs_name stopped by its time limit; its JSON holds the configurations done"
  [[ $brs_one -ne 0 ]] && brs_rc=$brs_one
  {
    echo "==== m3msa bench $brs_name $brs_flags (exit $brs_one, $((SECONDS - brs_t)) s)"
    grep -E "^\| " "$brs_dir/$brs_name.log"
  } >>"$OUT/bench_results.txt"
done
tar czf "$OUT/bench_results.tgz" -C "$brs_dir" .
rm -rf "$brs_dir"
grep -E "^====" "$OUT/bench_results.txt"
step_result "bench results ($((SECONDS - brs_start)) s)" $brs_rc
