#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer build of the CPU library and its tests,
# in build-asan, without CUDA, then every CPU test under CTest. Any sanitizer report fails the run
# (UBSan does not recover; ASan aborts on the first error; leaks are errors).
#   scripts/sanitize.sh            build + run
#   JOBS=N scripts/sanitize.sh     build and test parallelism (default: nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${JOBS:-$(nproc)}
build=build-asan
start=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DM3MSA_ENABLE_CUDA=OFF -DM3MSA_SANITIZE=ON -DM3MSA_BUILD_CLI=ON -DM3MSA_BUILD_PYTHON=OFF \
  >/dev/null
cmake --build "$build" -j "$jobs"
built=$(date +%s)
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# install_consumer builds an outside project against the installed library without the
# sanitizer runtime, so it cannot link an instrumented archive: it runs in the plain build only.
ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 900 -L cpu -E '^install_consumer$'
end=$(date +%s)
echo "sanitize: build $((built - start)) s, tests $((end - built)) s"
