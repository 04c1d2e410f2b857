#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks to build and test m3msa (idempotent; quick when
# everything is present). The CUDA toolkit is expected under /usr/local/cuda where there is one;
# without nvcc the CPU backend is built alone.
set -euo pipefail
packages=(cmake ninja-build g++ libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev libfmt-dev
          clang libclang-rt-14-dev python3-numpy pybind11-dev python3-dev
          python3-torch)  # torch: the m3msa.torch / m3msa.vllm tests (they skip without it)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
