#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine (no network there).
#
#   bash profiling/gpu_check.sh OUTDIR      build, GPU tests, exactness gate on cuda, kernel
#                                           benchmarks; writes OUTDIR/gpu_report.md (< 8 minutes)
#   bash profiling/gpu_check.sh --dry-run   on any machine: checks that every step the real run
#                                           needs is present (scripts, imports, test collection)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [[ "${1:-}" == "--dry-run" ]]; then
  echo "dry run: checking the GPU check's steps"
  for f in setup.py profiling/e2e_gate.py profiling/bench_kernels.py profiling/bench_attention.py \
           profiling/ptxas_report.py profiling/nsys_session.sh profiling/ncu_kernels.sh; do
    [[ -f "$f" ]] || { echo "missing: $f"; exit 1; }
    echo "  present: $f"
  done
  $PY -c "import dspark, dspark.backends.cuda, dspark.session, dspark.worker; print('  imports: ok')"
  $PY -c "import setuptools, pybind11; print('  build tools: ok')"
  n=$($PY -m pytest -q --collect-only tests 2>/dev/null | grep -c '\[cuda' || true)
  [[ "$n" -gt 0 ]] || { echo "no cuda tests collected"; exit 1; }
  echo "  cuda tests collected: $n"
  $PY profiling/bench_kernels.py --dry-run >/dev/null && echo "  bench_kernels --dry-run: ok"
  $PY profiling/e2e_gate.py --help >/dev/null && echo "  e2e_gate: ok"
  echo "dry run OK"
  exit 0
fi

OUT=${1:?usage: gpu_check.sh OUTDIR | --dry-run}
mkdir -p "$OUT"
REPORT="$OUT/gpu_report.md"
export PYTHONUNBUFFERED=1 DSPARK_REQUIRE_CUDA=1
step() { echo "== $1 ($(date +%T))"; }

step "build"
$PY -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -3 || \
  $PY setup.py -q build_ext --inplace
$PY -m dspark info | tee "$OUT/info.txt"

step "tests with the cuda backend"
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8" || true)  # parallel when pytest-xdist is there
set +e
timeout 240 $PY -m pytest -q -p no:cacheprovider $XDIST tests -k "cuda or gpu" 2>&1 | tee "$OUT/tests.txt"
timeout 120 $PY -m pytest -q -p no:cacheprovider $XDIST tests -k "not cuda and not gpu" 2>&1 | tail -5 | tee -a "$OUT/tests.txt"

step "end-to-end gate on cuda"
timeout 90 $PY profiling/e2e_gate.py --backend cuda --quick 2>&1 | tee "$OUT/gate.txt"

step "kernel benchmarks"
timeout 120 $PY profiling/bench_kernels.py 2>&1 | tee "$OUT/bench.txt"
set -e

{
  echo "# GPU check $(date -u +%F)"
  echo
  echo '```'; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true; echo '```'
  echo; echo "## dspark info"; echo '```'; cat "$OUT/info.txt"; echo '```'
  echo; echo "## tests"; echo '```'; tail -15 "$OUT/tests.txt"; echo '```'
  echo; echo "## exactness gate (cuda)"; echo '```'; cat "$OUT/gate.txt"; echo '```'
  echo; echo "## kernel benchmarks"; echo '```'; cat "$OUT/bench.txt"; echo '```'
} > "$REPORT"
echo "wrote $REPORT"
