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
