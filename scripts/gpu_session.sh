#!/bin/bash
# The lead's one device call (binaries in build-l/, carried): correctness steps, then the benchmarks; everything packed into one archive.
export M3MSA_COMMIT=${M3MSA_COMMIT:-unknown}
R=$OUT; mkdir -p $R/c $R/b
export BUILD=build-l
OUT=$R/c STEPS=${CSTEPS:-tests,cp-tests,runtime-tests,python-gpu} TEST_TIMEOUT=200 CP_TEST_TIMEOUT=150 RUNTIME_TEST_TIMEOUT=150 PYGPU_TIMEOUT=150 timeout ${CTIME:-300} bash scripts/gpu_check.sh > $R/c/run.log 2>&1
if [[ -n "${BSTEPS:-}" ]]; then
  OUT=$R/b STEPS=$BSTEPS QUICK=1 BENCH_CP_TIMEOUT=100 BENCH_LAYER_TIMEOUT=100 timeout 220 bash scripts/gpu_check.sh > $R/b/run.log 2>&1
fi
if [[ -n "${IDX_ARGS:-}" ]]; then
  timeout ${IDX_TIME:-200} build-l/cli/m3msa bench indexer $IDX_ARGS --commit $M3MSA_COMMIT --json $R/b/bench_indexer_full.json > $R/b/bench_indexer_full.log 2>&1
fi
if [[ -n "${STEP_BENCH:-}" ]]; then
  timeout 60 build-l/cli/m3msa bench sparse-step --commit $M3MSA_COMMIT --json $R/b/sparse_step.json > $R/b/sparse_step.log 2>&1
fi
cat $R/c/summary.txt $R/b/summary.txt 2>/dev/null > $R/summary_all.txt
tar czf $R/all.tgz -C $R c b
rm -rf $R/c $R/b
cat $R/summary_all.txt
