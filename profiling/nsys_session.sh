#!/usr/bin/env bash
# Nsight Systems timeline of a speculative-decoding workload on the cuda backend, and its summary:
# the NVTX ranges (domain "dspark": prime, draft, propose, snapshot, verify, accept, commit,
# rollback, ingest), the CUDA API calls (launches, copies, synchronisations) and the kernels.
#
#   bash profiling/nsys_session.sh [OUTDIR] [extra args for profiling/session_workload.py]
#   bash profiling/nsys_session.sh --which      print the nsys it would use (exit 2 if none)
#
# nsys is looked for on PATH, then in the Nsight Systems install folders (NSYS=/path overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

find_nsys() {
  local c
  for c in "${NSYS:-}" "$(command -v nsys 2>/dev/null)" /opt/nvidia/nsight-systems/*/bin/nsys \
           /opt/nvidia/nsight-systems/*/target-linux-x64/nsys /usr/local/cuda/bin/nsys \
           /usr/local/cuda*/nsight-systems*/bin/nsys /usr/local/cuda*/nsight-systems*/target-linux-x64/nsys \
           /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys /usr/lib/nsight-systems/bin/nsys; do
    [[ -n "$c" && -x "$c" ]] && { echo "$c"; return 0; }
  done
  return 1
}

if [[ "${1:-}" == "--which" ]]; then
  find_nsys || { echo "nsys not found (PATH, /opt/nvidia/nsight-systems/*, /usr/local/cuda*/nsight-systems*)"; exit 2; }
  exit 0
fi
OUT=${1:-profiling/out}; shift || true
mkdir -p "$OUT"
NSYS_BIN=$(find_nsys) || { echo "nsys not found: set NSYS=/path/to/nsys"; exit 2; }
# No CPU sampling or context switches: they need perf permissions a container rarely grants.
DSPARK_NVTX=1 "$NSYS_BIN" profile --trace=cuda,nvtx --sample=none --cpuctxsw=none --force-overwrite=true \
  -o "$OUT/dspark_session" "$PY" profiling/session_workload.py --backend cuda "$@"
"$NSYS_BIN" stats --force-export=true --report nvtx_sum,cuda_api_sum,cuda_gpu_kern_sum \
  "$OUT/dspark_session.nsys-rep" | tee "$OUT/nsys_stats.txt"
