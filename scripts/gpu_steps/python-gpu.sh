# Step `python-gpu` of scripts/gpu_check.sh (sourced there, on the GPU machine): builds the m3msa
# Python module against that machine's python3 (the one with torch; pybind11 from pip) into
# build-pygpu/ (sm_90a, library + module only, no CLI or C++ tests), then runs every Python suite
# with it: the CPU ones and test_cuda_*.py (torch on the GPU), with M3MSA_REQUIRE_CUDA=1 so a CUDA
# suite that would skip fails instead. Log: $OUT/python_gpu.log. Pass: "python-gpu (...): ok" in
# the summary and "OK" (skips only for "needs two GPUs" on one GPU) at the end of the log.
#
# Header-only dependencies: the library's CMake wants fmt and nlohmann_json. Where the GPU machine
# lacks them, carry build-pydeps/ (made here by `bash scripts/gpu_steps/python-gpu.sh stage`, from
# this machine's Debian headers); the step then points CMake at small config shims over them.
#
#   PYGPU_BUILD  build folder (default build-pygpu)     PYGPU_JOBS  build jobs (default nproc)
#   PYGPU_TIMEOUT  seconds for the test run (default 300)
#   PYGPU_BENCH  1 (default): then bench/torch_ops.py (the torch ops and the vLLM entry points
#                under graph replay against the raw calls) to $OUT/torch_ops.json

pygpu_stage() {  # here, not on the GPU machine: copy the header-only dependencies to carry
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  rm -rf "$root/build-pydeps"
  mkdir -p "$root/build-pydeps/include"
  cp -r /usr/include/fmt /usr/include/nlohmann "$root/build-pydeps/include/"
  echo "staged $(du -sh "$root/build-pydeps" | cut -f1) in build-pydeps/: carry it with STEPS=python-gpu"
}

# CMake package configs for fmt (header-only target) and nlohmann_json over carried headers.
pygpu_write_shims() {  # shim_dir include_dir
  mkdir -p "$1/fmt" "$1/nlohmann_json"
  cat >"$1/fmt/fmtConfig.cmake" <<EOF
if(NOT TARGET fmt::fmt-header-only)
  add_library(fmt::fmt-header-only INTERFACE IMPORTED)
  set_target_properties(fmt::fmt-header-only PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "$2" INTERFACE_COMPILE_DEFINITIONS FMT_HEADER_ONLY=1)
endif()
set(fmt_VERSION 9.1.0)
EOF
  cat >"$1/nlohmann_json/nlohmann_jsonConfig.cmake" <<EOF
if(NOT TARGET nlohmann_json::nlohmann_json)
  add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
  set_target_properties(nlohmann_json::nlohmann_json PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "$2")
endif()
set(nlohmann_json_VERSION 3.11.2)
EOF
  printf 'set(PACKAGE_VERSION 9.1.0)\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n' \
    >"$1/fmt/fmtConfigVersion.cmake"
  printf 'set(PACKAGE_VERSION 3.11.2)\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n' \
    >"$1/nlohmann_json/nlohmann_jsonConfigVersion.cmake"
}

pygpu_run() {
  local root build log py args=() jobs rc start_build
  root=$(pwd)
  build=${PYGPU_BUILD:-build-pygpu}
  log="$OUT/python_gpu.log"
  jobs=${PYGPU_JOBS:-$(nproc)}
  py=$(command -v python3)
  : >"$log"
  {
    echo "python3: $py ($("$py" --version 2>&1))"
    "$py" -c 'import torch, numpy, pybind11; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), "numpy", numpy.__version__, "pybind11", pybind11.__version__)'
  } >>"$log" 2>&1 || { echo "python3 lacks torch / numpy / pybind11" >>"$log"; return 1; }

  args+=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a -DM3MSA_ENABLE_CUDA=ON
         -DM3MSA_BUILD_TESTS=OFF -DM3MSA_BUILD_CLI=OFF -DM3MSA_BUILD_PYTHON=ON
         -DM3MSA_PYTHON_PRIVATE_RUNTIME=${PYGPU_PRIVATE_RUNTIME:-ON}
         "-DPython3_EXECUTABLE=$py" "-Dpybind11_DIR=$("$py" -m pybind11 --cmakedir)")
  command -v ninja >/dev/null && args+=(-G Ninja)
  if ! [[ -x /usr/local/cuda/bin/nvcc ]] && command -v nvcc >/dev/null; then
    args+=("-DCMAKE_CUDA_COMPILER=$(command -v nvcc)")
  fi
  # NCCL: the toolkit's where it has one, else the pip wheel next to torch (nvidia-nccl-cu13).
  local cuda_root nccl_dir
  cuda_root=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")")
  if ! compgen -G "$cuda_root/lib*/libnccl.so*" >/dev/null &&
     ! compgen -G "$cuda_root/targets/*/lib/libnccl.so*" >/dev/null &&
     ! compgen -G "/usr/lib/*-linux-gnu/libnccl.so*" >/dev/null; then
    nccl_dir=$("$py" -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)
    if [[ -n "$nccl_dir" && -e "$nccl_dir/include/nccl.h" ]]; then
      args+=("-DM3MSA_NCCL_LIBRARY=$(ls "$nccl_dir"/lib/libnccl.so* | head -n 1)"
             "-DCMAKE_CXX_FLAGS=-I$nccl_dir/include" "-DCMAKE_CUDA_FLAGS=-I$nccl_dir/include")
      echo "NCCL from $nccl_dir" >>"$log"
    fi
  fi
  if [[ -d build-pydeps/include ]]; then
    pygpu_write_shims "$root/$build/shims" "$root/build-pydeps/include"
    args+=("-Dfmt_DIR=$root/$build/shims/fmt" "-Dnlohmann_json_DIR=$root/$build/shims/nlohmann_json")
    echo "fmt / nlohmann_json: carried headers in build-pydeps/" >>"$log"
  fi

  echo "== configure: cmake -S . -B $build ${args[*]}" >>"$log"
  if ! cmake -S . -B "$build" "${args[@]}" >>"$log" 2>&1; then
    [[ -d build-pydeps ]] || echo "configure failed; if fmt / nlohmann_json are missing here," \
      "carry build-pydeps (made by: bash scripts/gpu_steps/python-gpu.sh stage)" | tee -a "$log"
    tail -n 20 "$log"
    return 2
  fi
  start_build=$SECONDS
  echo "== build: m3msa_python, $jobs jobs" >>"$log"
  if ! cmake --build "$build" --target m3msa_python -j "$jobs" >>"$log" 2>&1; then
    grep -E "error|Error" "$log" | head -n 20
    return 3
  fi
  echo "== built in $((SECONDS - start_build)) s" >>"$log"

  echo "== import check" >>"$log"
  (cd python/tests && PYTHONPATH="$root/$build/python" "$py" -X faulthandler -c \
     'import torch, m3msa; print("import ok:", m3msa.__file__, "cuda", m3msa.cuda_available() if hasattr(m3msa, "cuda_available") else "?")') >>"$log" 2>&1
  if ! (cd python/tests && PYTHONPATH="$root/$build/python" "$py" -c 'import numpy, m3msa' >/dev/null 2>&1); then
    echo "== import failed: native backtrace (cuda-gdb)" >>"$log"
    (cd python/tests && PYTHONPATH="$root/$build/python" timeout 120 cuda-gdb -batch -ex run -ex bt \
       --args "$py" -c 'import numpy, m3msa') >>"$log" 2>&1
    ldd "$root/$build"/python/m3msa/_m3msa*.so >>"$log" 2>&1
  fi
  echo "== tests: every python/tests/test_*.py with $py" >>"$log"
  (cd python/tests &&
     PYTHONPATH="$root/$build/python" M3MSA_README="$root/python/README.md" \
     M3MSA_REQUIRE_CUDA=1 M3MSA_TEST_THREADS=${M3MSA_TEST_THREADS:-8} PYTHONDONTWRITEBYTECODE=1 \
     timeout "${PYGPU_TIMEOUT:-300}" "$py" -X faulthandler -B -m unittest discover -v -p 'test_*.py') >>"$log" 2>&1
  rc=$?
  grep -E "^(FAIL|ERROR):|^Ran |^OK|^FAILED|skipped '" "$log" | tail -n 40
  # The torch entry points under graph replay against the raw calls (bench/torch_ops.py);
  # PYGPU_BENCH=0 skips it.
  if [[ "${PYGPU_BENCH:-1}" == 1 ]]; then
    echo "== bench/torch_ops.py" >>"$log"
    # shellcheck disable=SC2086
    (PYTHONPATH="$root/$build/python" timeout "${PYGPU_BENCH_TIMEOUT:-240}" "$py" \
       bench/torch_ops.py --json "$OUT/torch_ops.json" ${QUICK_FLAG:-}) >>"$log" 2>&1 ||
      echo "bench/torch_ops.py failed (exit $?)" >>"$log"
    sed -n '/^== bench\/torch_ops.py/,$p' "$log" | tail -n 40
  fi
  return $rc
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  # Run directly: `stage` copies the headers to carry; anything else runs the step standalone.
  if [[ "${1:-}" == stage ]]; then pygpu_stage; exit $?; fi
  OUT=${OUT:-$PWD/out}
  mkdir -p "$OUT"
  pygpu_run
  exit $?
fi

start=$SECONDS
pygpu_run
step_result "python-gpu: build + python suites ($((SECONDS - start)) s)" $?
