# STEPS=cp-tests: the CP tests on the GPU machine, every run under `timeout`.
#  1. in-process (ranks as threads):  CudaCp.* and CudaCpFaults.*             -> $OUT/cp_tests.log
#  2. multi-process (2 GPUs only), through `m3msa launch -n 2`, rank logs
#     concatenated into $OUT/cp_mp.log:
#     a. CudaCpMultiProcess.*  (bit-identity of every transport through IPC, graph replays, a rank
#        passing another shape): launch exit 0 and "[  PASSED  ]" in both rank logs;
#     b. CudaCpMultiProcessDeath.* with M3MSA_CP_TEST_DIE_RANK=1 (rank 1 _exits mid-step with 42),
#        for transports peer and nccl: launch exit 42 (the dead rank's status), rank 0 "[  PASSED  ]"
#        (it reported kTimeout naming rank 1 within the budget and left cleanly).
# On a 1-GPU machine part 2 is skipped with a note. CP_DEBUG=1 sets M3MSA_CP_DEBUG=1 for part 2
# (per-call generation / tag / call-word lines on stderr). CP_TEST_TIMEOUT bounds part 1 (s).
cp_start=$SECONDS
cp_rc=0
cp_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
timeout "${CP_TEST_TIMEOUT:-400}" "$TESTS" --gtest_filter='CudaCp.*:CudaCpFaults.*' \
  >"$OUT/cp_tests.log" 2>&1 || cp_rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|^\[==========\]|Failure|timeout after|passes another" \
  "$OUT/cp_tests.log" | tail -n 40
[[ $cp_rc -ne 0 ]] && note "cp-tests: in-process suite rc $cp_rc (124 = timeout)"

# One launch: name, expected exit status, env assignments..., -- gtest filter. Appends the rank logs
# to $OUT/cp_mp.log; checks the status and that rank 0 (and rank 1 unless it is meant to die)
# passed.
cp_launch() {
  local name=$1 expect=$2 filter=$3 die=$4 transport=$5
  local dir
  dir=$(mktemp -d)
  local launch_rc=0
  env M3MSA_CP_DEBUG="${CP_DEBUG:-0}" M3MSA_CP_TEST_DIE_RANK="$die" \
    M3MSA_CP_TEST_TRANSPORT="$transport" \
    timeout 150 "$CLI" launch -n 2 --timeout 120 --grace 30 --log-dir "$dir" -- \
    "$TESTS" --gtest_filter="$filter" >"$dir/launch.log" 2>&1 || launch_rc=$?
  {
    echo "######## $name: launch exit $launch_rc (expected $expect)"
    cat "$dir/launch.log"
    for r in 0 1; do
      echo "######## $name: rank $r"
      cat "$dir/rank$r.log" 2>/dev/null || echo "(no log)"
    done
  } >>"$OUT/cp_mp.log"
  # A rank passed when it ran tests, none failed and none skipped (a skip means the launch
  # environment did not reach it).
  local ok=1 ranks="0 1"
  [[ -n "$die" ]] && ranks="0"
  [[ $launch_rc -eq $expect ]] || ok=0
  for r in $ranks; do
    grep -q "^\[  PASSED  \] [1-9]" "$dir/rank$r.log" 2>/dev/null || ok=0
    grep -q "^\[  FAILED  \]\|^\[  SKIPPED \]" "$dir/rank$r.log" 2>/dev/null && ok=0
  done
  grep -h -E "^\[  (PASSED|FAILED) |^\[  FAILED|survivor after|mismatched call|launch: rank" \
    "$dir"/*.log | head -n 20
  rm -rf "$dir"
  if [[ $ok -eq 1 ]]; then
    note "cp-tests: $name: ok (launch exit $launch_rc)"
  else
    note "cp-tests: $name: FAILED (launch exit $launch_rc, expected $expect; see cp_mp.log)"
    cp_rc=1
  fi
}

if [[ $cp_gpus -lt 2 ]]; then
  note "cp-tests: multi-process part skipped: $cp_gpus GPU(s) visible, needs 2"
else
  : >"$OUT/cp_mp.log"
  cp_launch "multi-process (IPC, all transports, graphs, shape mismatch)" 0 \
    'CudaCpMultiProcess.*' "" peer
  cp_launch "rank 1 dies mid-step, peer" 42 'CudaCpMultiProcessDeath.*' 1 peer
  cp_launch "rank 1 dies mid-step, nccl" 42 'CudaCpMultiProcessDeath.*' 1 nccl
fi
step_result "cp-tests ($((SECONDS - cp_start)) s)" $cp_rc
