#!/usr/bin/env bash
# Fresh machine -> the main job: install dependencies, build, run `m3msa demo` (on the GPU when
# there is one, on the CPU otherwise). Extra arguments go to the demo; `scripts/demo.sh --moe` runs
# the model with the mixture of experts (MXFP8) after every sparse layer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target m3msa_cli
./build/cli/m3msa demo "$@"
