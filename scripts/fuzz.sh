#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan, no CUDA) in build-fuzz and runs each one for
# a bounded time, starting from its committed seed corpus in fuzz/corpus/<target>/. Prints the
# executions and crashes per target; exits non-zero if any target crashed (the reproducer is kept
# under build-fuzz/artifacts/<target>/).
#   scripts/fuzz.sh [seconds-per-target]   default 20 (the CI smoke run)
#   FUZZ_TARGETS="fuzz_batch fuzz_npy"     run only these
#   JOBS=N                                 build parallelism (default: nproc)
#   M3MSA_FUZZ_SEED=S                      libFuzzer seed (default 1: CI explores the same inputs each run)
# Reproduce a crash: build-fuzz/fuzz/<target> build-fuzz/artifacts/<target>/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
jobs=${JOBS:-$(nproc)}
build=build-fuzz
targets=${FUZZ_TARGETS:-"fuzz_config fuzz_batch fuzz_tensor fuzz_npy fuzz_reference fuzz_runtime fuzz_cli_args"}

start=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DM3MSA_ENABLE_CUDA=OFF \
  -DM3MSA_SANITIZE=ON -DM3MSA_BUILD_FUZZERS=ON -DM3MSA_BUILD_TESTS=OFF -DM3MSA_BUILD_CLI=OFF \
  -DM3MSA_BUILD_PYTHON=OFF \
  >/dev/null
# shellcheck disable=SC2086
cmake --build "$build" -j "$jobs" --target $targets
echo "fuzz: build $(( $(date +%s) - start )) s"

export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
failed=0
summary=$(printf '%-16s %8s %12s %10s %8s %8s\n' target seconds executions exec/s corpus crashes)
for target in $targets; do
  seeds=fuzz/corpus/$target
  corpus=$build/corpus/$target          # grows here; the committed seeds stay as they are
  artifacts=$build/artifacts/$target
  log=$build/logs/$target.log
  rm -rf "$artifacts"
  mkdir -p "$corpus" "$artifacts" "$(dirname "$log")" "$seeds"
  dict=()
  [ -f "fuzz/$target.dict" ] && dict=(-dict="fuzz/$target.dict")
  set +e
  "$build/fuzz/$target" -max_total_time="$seconds" -seed="${M3MSA_FUZZ_SEED:-1}" -print_final_stats=1 -timeout=10 \
    -rss_limit_mb=2048 -malloc_limit_mb=1024 -max_len=4096 -artifact_prefix="$artifacts/" \
    "${dict[@]}" "$corpus" "$seeds" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  size=$(find "$corpus" -type f | wc -l)
  crashes=$(find "$artifacts" -type f | wc -l)
  if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then crashes=1; fi
  summary+=$(printf '\n%-16s %8s %12s %10s %8s %8s' "$target" "$seconds" "${execs:-?}" \
    "${rate:-?}" "$size" "$crashes")
  if [ "$crashes" -ne 0 ]; then
    failed=1
    echo "fuzz: $target FAILED (exit $rc); last lines of $log:" >&2
    tail -40 "$log" >&2
  fi
done
echo "$summary"
echo "fuzz: total $(( $(date +%s) - start )) s"
exit "$failed"
