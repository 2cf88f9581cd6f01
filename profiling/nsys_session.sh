#!/usr/bin/env bash
# Nsight Systems timeline of a speculative-decoding workload on the cuda backend. The NVTX
# ranges (domain "dspark") mark each round phase: prime, draft, propose, snapshot, verify,
# accept, commit, rollback, ingest.
#
#   bash profiling/nsys_session.sh [OUTDIR] [extra args for profiling/session_workload.py]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-profiling/out}; shift || true
mkdir -p "$OUT"
NSYS=${NSYS:-$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1)}
[[ -x "$NSYS" ]] || { echo "nsys not found: set NSYS=/path/to/nsys"; exit 2; }
DSPARK_NVTX=1 "$NSYS" profile --trace=cuda,nvtx,osrt --force-overwrite=true -o "$OUT/dspark_session" \
  python3 profiling/session_workload.py --backend cuda "$@"
"$NSYS" stats --report nvtx_sum,cuda_gpu_kern_sum "$OUT/dspark_session.nsys-rep" | tee "$OUT/nsys_stats.txt"
