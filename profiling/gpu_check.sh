#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine, at most 8 minutes, no package registry there.
#
#   bash profiling/gpu_wheels.sh            here, beforehand: the wheels the GPU image lacks, for its
#                                           Python 3.12, into profiling/wheels/ (git-ignored)
#   bash profiling/gpu_check.sh OUTDIR      on the GPU machine: writes OUTDIR/gpu_report.md step by step
#   bash profiling/gpu_check.sh --dry-run [OUTDIR]
#                                           anywhere: every step that can run without a GPU (CI runs it)
#
# Steps, each with its own timeout and a status line in the report even when it fails: wheels
# (pip --no-index from profiling/wheels), build (the simt module; the cuda backend needs none of
# it: its signatures come from the sources), info, cubins (compile and load every family for the
# device), the cuda tests, compute-sanitizer memcheck / racecheck / synccheck over the small
# per-family cuda tests, an Nsight Systems capture of the session workload with its NVTX summary,
# an Nsight Compute report of the verify attention kernel, the exactness gate on cuda, the
# performance model's predictions (profiling/perf_model.py) and the kernel benchmarks at
# Qwen3.5-27B's shapes (B = 1, 2, 32; contexts 4k and 32k), each row measured beside predicted.
# A missing tool (nsys is often off PATH) is a step status, not an abort.
# Exit code 1 if any step failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
  DRY=1
  OUT=${2:-$(mktemp -d)}
else
  OUT=${1:?usage: gpu_check.sh OUTDIR | --dry-run [OUTDIR]}
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPORT="$OUT/gpu_report.md"
BUDGET=${GPU_CHECK_BUDGET:-470}   # seconds for all steps; the report is written as they go
START=$SECONDS
FAILED=0
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[[ $DRY == 1 ]] || export DSPARK_REQUIRE_CUDA=1   # a cuda test that skips would hide a failure
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8" || true)

report() { printf '%s\n' "$@" >> "$REPORT"; }

# step NAME SECONDS CMD... : run CMD under a timeout (cut to what is left of the budget), keep its
# log, and append its status and the log's tail to the report.
step() {
  local name=$1 limit=$2 rc status t0=$SECONDS
  shift 2
  local left=$(( BUDGET - (SECONDS - START) ))
  (( limit > left )) && limit=$left
  local log="$OUT/$name.log"
  if (( limit < 5 )); then
    status="skipped (the time budget of ${BUDGET}s is spent)"
    : > "$log"
  else
    echo "== $name (timeout ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    case $rc in
      0) status=ok ;;
      124|137) status="TIMEOUT after ${limit}s"; FAILED=1 ;;
      *) status="FAILED (exit $rc)"; FAILED=1 ;;
    esac
  fi
  report "## $name: $status ($(( SECONDS - t0 ))s)" "" "\`$*\`" "" '```' "$(tail -n "${TAIL:-30}" "$log")" '```' ""
  echo "   $name: $status"
}

# skip NAME WHY : a step that cannot run here, with its reason.
skip() {
  report "## $1: $2" ""
  echo "== $1: $2"
}

{
  echo "# GPU check $(date -u +%FT%TZ)$([[ $DRY == 1 ]] && echo ' (dry run: no GPU)')"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "nvidia-smi: not available"
  $PY -c "import sys, platform; print('python', sys.version.split()[0], platform.machine())"
  $PY -c "import cupy; print('cupy', cupy.__version__)" 2>/dev/null || echo "cupy: not importable"
  echo '```'
  echo
} > "$REPORT"

# ---- wheels: what the image lacks, from profiling/wheels (no registry on the GPU machine) -----------
shopt -s nullglob
WHEELS=(profiling/wheels/*.whl)
if (( ${#WHEELS[@]} == 0 )); then
  skip wheels "skipped (no profiling/wheels/*.whl: run bash profiling/gpu_wheels.sh where a registry is reachable)"
elif [[ $DRY == 1 ]]; then
  step wheels 30 $PY -c "import sys, zipfile; [print(w, len(zipfile.ZipFile(w).namelist()), 'files') for w in sys.argv[1:]]" \
    "${WHEELS[@]}"
else
  step wheels 60 $PY -m pip install -q --no-index --no-deps "${WHEELS[@]}"
fi

# ---- build: the simt module (kernel tests compare cuda with it); the cuda backend does not need it ----
if [[ $DRY == 1 ]]; then
  step build 30 $PY -c "import setuptools, pybind11, dspark._simt; print('build tools and dspark._simt: ok')"
else
  step build 150 $PY setup.py -q build_ext --inplace
fi
step info 45 bash -c "$PY -m dspark info && $PY -c 'from dspark import profile; print(\"NVTX:\", profile.nvtx_status())'"

# ---- cubins: every family compiled by dspark's NVRTC options for the device, loaded by path ----------
if [[ $DRY == 1 ]]; then
  step cubins 120 $PY profiling/load_cubins.py --contract
else
  step cubins 120 $PY profiling/load_cubins.py
fi

# ---- tests ---------------------------------------------------------------------------------------------
if [[ $DRY == 1 ]]; then
  step cuda_tests 120 bash -c "n=\$($PY -m pytest -q -p no:cacheprovider --collect-only tests -k 'cuda or gpu' | grep -c '::'); \
    echo \"cuda/gpu tests collected: \$n\"; [[ \$n -gt 0 ]]"
else
  step cuda_tests 180 $PY -m pytest -q -p no:cacheprovider $XDIST tests -k "cuda or gpu" -rs
fi

# ---- compute-sanitizer over the small per-family cuda tests (every op once; one cudaMalloc per array) --
SANITIZER=$(command -v compute-sanitizer 2>/dev/null)
for c in /usr/local/cuda*/bin/compute-sanitizer /usr/local/cuda*/compute-sanitizer/compute-sanitizer; do
  [[ -z "$SANITIZER" && -x "$c" ]] && SANITIZER=$c
done
[[ $DRY == 1 ]] && step sanitizer_targets 60 $PY -m pytest -q -p no:cacheprovider --collect-only tests/gpu/test_cuda_ops.py
for tool in memcheck racecheck synccheck; do
  if [[ $DRY == 1 ]]; then
    skip "sanitizer_$tool" "not run (dry run: needs a GPU); compute-sanitizer: ${SANITIZER:-not found}"
  elif [[ -z "$SANITIZER" ]]; then
    skip "sanitizer_$tool" "MISSING: compute-sanitizer not found"
  else
    step "sanitizer_$tool" 60 env DSPARK_CUDA_POOL=0 "$SANITIZER" --tool "$tool" --error-exitcode 3 \
      --target-processes all $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_cuda_ops.py
  fi
done

# ---- Nsight Systems: the session workload with its NVTX phase summary -----------------------------------
if NSYS_PATH=$(bash profiling/nsys_session.sh --which 2>&1); then NSYS_OK=1; else NSYS_OK=0; fi
if [[ $DRY == 1 ]]; then
  skip nsys "not run (dry run: needs a GPU); nsys: $NSYS_PATH"
  step nsys_workload 60 $PY profiling/session_workload.py --backend numpy --model tiny --requests 2 --tokens 16 --nvtx
elif [[ $NSYS_OK == 0 ]]; then
  skip nsys "MISSING: $NSYS_PATH"
else
  TAIL=80 step nsys 90 bash profiling/nsys_session.sh "$OUT/nsys" --requests 4 --tokens 64
fi

# ---- Nsight Compute: the verify attention kernel ------------------------------------------------------
if NCU_PATH=$(bash profiling/ncu_kernels.sh --which 2>&1); then NCU_OK=1; else NCU_OK=0; fi
if [[ $DRY == 1 ]]; then
  skip ncu "not run (dry run: needs a GPU); ncu: $NCU_PATH"
  step verify_launch 60 $PY profiling/verify_launch.py --backend simt --ctx 70 --rows 4 --heads 4 2 64
elif [[ $NCU_OK == 0 ]]; then
  skip ncu "MISSING: $NCU_PATH"
else
  TAIL=60 step ncu_verify_attention 90 bash profiling/ncu_kernels.sh --verify "$OUT/ncu"
fi

# ---- the exactness gate, the performance model and the kernel benchmarks (measured beside predicted) -----
TAIL=40 step perf_model 30 $PY profiling/perf_model.py --model qwen3.5-27b --batch 1 2 32 --context 4096 32768
if [[ $DRY == 1 ]]; then
  step gate 30 $PY profiling/e2e_gate.py --help
  TAIL=60 step bench 60 $PY profiling/bench_kernels.py --dry-run
else
  step gate 60 $PY profiling/e2e_gate.py --backend cuda --quick
  TAIL=200 step bench 150 $PY profiling/bench_kernels.py
fi

report "Total: $(( SECONDS - START ))s of a ${BUDGET}s budget; $([[ $FAILED == 0 ]] && echo 'every step that ran passed' || echo 'SOME STEPS FAILED')."
echo "wrote $REPORT ($(( SECONDS - START ))s)"
[[ $DRY == 1 && $FAILED == 0 ]] && echo "dry run OK"
exit $FAILED
