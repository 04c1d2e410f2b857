# STEPS=pip-install: `pip install --no-build-isolation ./python` with the GPU machine's python3
# (scikit-build-core, pybind11 and torch from pip there) into a scratch target folder, then imports
# the installed m3msa, m3msa.torch and m3msa.vllm and runs the torch-op and vLLM suites against it
# (M3MSA_REQUIRE_CUDA=1: a CUDA class that would skip fails). Checks that the wheel's entry point
# `vllm.general_plugins` names m3msa.vllm:register. Log: $OUT/pip_install.log.
# PIP_INSTALL_TIMEOUT bounds the build (s, default 480).
pi_start=$SECONDS
pi_log="$OUT/pip_install.log"
pi_target=$(mktemp -d)
pi_rc=0
{
  echo "python3: $(command -v python3) ($(python3 --version 2>&1))"
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "${PIP_INSTALL_TIMEOUT:-480}" \
    python3 -m pip install --no-build-isolation --no-deps --target "$pi_target" \
    --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90a ./python
} >"$pi_log" 2>&1 || pi_rc=$?
if [[ $pi_rc -eq 0 ]]; then
  (cd python/tests && PYTHONPATH="$pi_target" M3MSA_REQUIRE_CUDA=1 PYTHONDONTWRITEBYTECODE=1 \
     python3 -B -c 'import m3msa, m3msa.torch, m3msa.vllm; print("installed:", m3msa.__file__, m3msa.info())' &&
   PYTHONPATH="$pi_target" M3MSA_REQUIRE_CUDA=1 PYTHONDONTWRITEBYTECODE=1 \
     python3 -B -m unittest test_torch_ops test_vllm) >>"$pi_log" 2>&1 || pi_rc=$?
  grep -h -A1 "vllm.general_plugins" "$pi_target"/m3msa-*.dist-info/entry_points.txt >>"$pi_log" 2>&1 ||
    { echo "no vllm.general_plugins entry point in the installed metadata" >>"$pi_log"; pi_rc=1; }
fi
tail -n 25 "$pi_log"
rm -rf "$pi_target"
step_result "pip-install: wheel build + import + torch/vllm suites ($((SECONDS - pi_start)) s)" $pi_rc
