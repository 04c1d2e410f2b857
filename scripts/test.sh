#!/usr/bin/env bash
# Fresh machine -> every test that runs here: install dependencies, build with warnings as errors,
# run the CTest suites (GPU tests skip with a reason where there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DM3MSA_WERROR=ON >/dev/null
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 900

# Reliability (docs/reliability.md): the CPU tests again under ASan + UBSan (build-asan), then a
# bounded libFuzzer run of every fuzz target (build-fuzz; M3MSA_FUZZ_SECONDS per target, default
# 20). M3MSA_RELIABILITY=0 skips both for a quick local run; CI always runs them.
if [ "${M3MSA_RELIABILITY:-1}" != 0 ]; then
  JOBS="$jobs" bash scripts/sanitize.sh
  JOBS="$jobs" bash scripts/fuzz.sh "${M3MSA_FUZZ_SECONDS:-20}"
fi
