#!/usr/bin/env bash
# One device call: correctness steps, then benchmarks, each run of scripts/gpu_check.sh
# under its own time limit, everything packed into $OUT/all.tgz (the device tool returns at most
# 8 files) with $OUT/summary_all.txt beside it. The binaries are built on the CPU machine
# (-DCMAKE_CUDA_ARCHITECTURES=90a) and carried in $BUILD.
#   BUILD   build folder (default build-l)
#   CSTEPS  correctness steps (default tests,demo-gpu), CTIME their limit (s, default 400)
#   BSTEPS  benchmark steps (default none), BTIME their limit (s, default 300); QUICK=1 for the
#           benchmarks' --quick subsets; the step files' own variables pass through
#   M3MSA_COMMIT  recorded in the JSON
# Example: CSTEPS=tests BSTEPS=bench-layer,bench-gemm M3MSA_COMMIT=abc123 bash scripts/gpu_session.sh
export M3MSA_COMMIT=${M3MSA_COMMIT:-unknown}
export BUILD=${BUILD:-build-l}
R=$OUT
mkdir -p "$R/c" "$R/b"
OUT=$R/c STEPS=${CSTEPS:-tests,demo-gpu} timeout "${CTIME:-400}" bash scripts/gpu_check.sh \
  >"$R/c/run.log" 2>&1
echo "== correctness steps: exit $?" >>"$R/c/summary.txt"
if [[ -n "${BSTEPS:-}" ]]; then
  OUT=$R/b STEPS=$BSTEPS timeout "${BTIME:-300}" bash scripts/gpu_check.sh >"$R/b/run.log" 2>&1
  echo "== benchmark steps: exit $?" >>"$R/b/summary.txt"
fi
cat "$R/c/summary.txt" "$R/b/summary.txt" 2>/dev/null >"$R/summary_all.txt"
tar czf "$R/all.tgz" -C "$R" c b
rm -rf "$R/c" "$R/b"
cat "$R/summary_all.txt"
