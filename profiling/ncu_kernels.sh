#!/usr/bin/env bash
# Nsight Compute on every dspark kernel of a short session workload (cuda backend): memory
# throughput and occupancy per kernel, one launch each after warm-up. Clocks are left alone.
#
#   bash profiling/ncu_kernels.sh [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-profiling/out}
mkdir -p "$OUT"
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
[[ -x "$NCU" ]] || { echo "ncu not found: set NCU=/path/to/ncu"; exit 2; }
"$NCU" --clock-control none --launch-skip 20 --launch-count 40 \
  --kernel-name 'regex:^(attention|kv_commit|gdn_scan|snapshot|checkpoint|argmax|greedy_accept|markov_chain|sample|spec_accept|philox)' \
  --section SpeedOfLight --section Occupancy --section LaunchStats \
  -o "$OUT/dspark_kernels" -f python3 profiling/session_workload.py --backend cuda --requests 4 --tokens 64
"$NCU" --import "$OUT/dspark_kernels.ncu-rep" --page details --csv > "$OUT/ncu_kernels.csv"
echo "wrote $OUT/dspark_kernels.ncu-rep and $OUT/ncu_kernels.csv"
