# STEPS=demo-gpu: `m3msa demo` on the CUDA runtime:
# the default model (M3's attention dimensions, hidden 6144, dense SwiGLU-OAI MLP 6144, 2 sparse
# layers, batch 4 x q-len 2, context 8192, 3 steps) at TP over the GPUs present (1 or 2: ranks as
# threads, NCCL), then the same with --weights fp8. Each run also checks a small configuration
# (hidden 512) layer by layer against the CPU runtime. Logs and JSON: $OUT/demo_gpu_bf16.{log,json},
# $OUT/demo_gpu_fp8.{log,json}. Pass: both exit 0 with "passed": true, the header says "on cuda",
# "prepare: active", "fallbacks none", every check "[ok]".
# DEMO_GPU_ARGS adds flags to both runs (e.g. "--tp 1" or "--layers 4 --steps 8");
# DEMO_GPU_TIMEOUT bounds each run (s, default 240).
dg_start=$SECONDS
dg_rc=0
dg_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
note "demo-gpu: $dg_gpus GPU(s) visible: TP $((dg_gpus >= 2 ? 2 : 1)) unless DEMO_GPU_ARGS sets --tp"
for dg_weights in bf16 fp8; do
  # shellcheck disable=SC2086
  timeout "${DEMO_GPU_TIMEOUT:-240}" "$CLI" demo --backend cuda --weights "$dg_weights" \
    --json "$OUT/demo_gpu_$dg_weights.json" ${DEMO_GPU_ARGS:-} >"$OUT/demo_gpu_$dg_weights.log" 2>&1
  dg_one=$?
  echo "---- m3msa demo --weights $dg_weights: exit $dg_one"
  # The progress lines (stderr, runs longer than 2 s) left out.
  grep -v -E "^(step [0-9]+/[0-9]+|building the|copying the|check: the oracle)" \
    "$OUT/demo_gpu_$dg_weights.log" | tail -n 30
  [[ $dg_one -ne 0 ]] && dg_rc=$dg_one
done
# And once with the CP indexer inside the runtime (--cp; DEMO_GPU_CP=0 skips it).
if [[ "${DEMO_GPU_CP:-1}" == 1 ]]; then
  # shellcheck disable=SC2086
  timeout "${DEMO_GPU_TIMEOUT:-240}" "$CLI" demo --backend cuda --cp --json "$OUT/demo_gpu_cp.json" \
    ${DEMO_GPU_ARGS:-} >"$OUT/demo_gpu_cp.log" 2>&1
  dg_one=$?
  echo "---- m3msa demo --cp: exit $dg_one"
  grep -v -E "^(step [0-9]+/[0-9]+|building the|copying the|check: the oracle)" \
    "$OUT/demo_gpu_cp.log" | tail -n 30
  [[ $dg_one -ne 0 ]] && dg_rc=$dg_one
fi
step_result "demo-gpu bf16 + fp8 + cp ($((SECONDS - dg_start)) s)" $dg_rc
