#!/usr/bin/env bash
# Nsight Compute on dspark's kernels (cuda backend). Clocks are left alone.
#
#   bash profiling/ncu_kernels.sh [OUTDIR]           every dspark kernel of a short session workload:
#                                                    memory throughput and occupancy, one launch each
#   bash profiling/ncu_kernels.sh --verify [OUTDIR]  the verify attention kernel alone (its split kernel, not the
#                                                    combine), at the benchmark trunk's shape
#                                                    (profiling/verify_launch.py), full set
#   bash profiling/ncu_kernels.sh --which            print the ncu it would use (exit 2 if none)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

find_ncu() {
  local c
  for c in "${NCU:-}" "$(command -v ncu 2>/dev/null)" /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu \
           /usr/local/cuda*/nsight-compute*/ncu; do
    [[ -n "$c" && -x "$c" ]] && { echo "$c"; return 0; }
  done
  return 1
}

MODE=session
case "${1:-}" in
  --which) find_ncu || { echo "ncu not found (PATH, /opt/nvidia/nsight-compute/*, /usr/local/cuda*)"; exit 2; }
           exit 0 ;;
  --verify) MODE=verify; shift ;;
esac
OUT=${1:-profiling/out}
mkdir -p "$OUT"
NCU_BIN=$(find_ncu) || { echo "ncu not found: set NCU=/path/to/ncu"; exit 2; }

if [[ $MODE == verify ]]; then
  "$NCU_BIN" --clock-control none --launch-skip 1 --launch-count 1 --kernel-name 'regex:^attention_(f32|f16|bf16)_d' \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section ComputeWorkloadAnalysis -o "$OUT/verify_attention" -f "$PY" profiling/verify_launch.py --backend cuda
  "$NCU_BIN" --import "$OUT/verify_attention.ncu-rep" --page details | tee "$OUT/verify_attention.txt"
  exit 0
fi
"$NCU_BIN" --clock-control none --launch-skip 20 --launch-count 40 \
  --kernel-name 'regex:^(attention|kv_commit|gdn_scan|gdn_conv|gdn_chunk|snapshot|checkpoint|argmax|greedy_accept|markov_chain|sample|spec_accept|pick_accept|philox|rmsnorm|add_rmsnorm|embed_rmsnorm|linear|round_activations|round_swiglu|round_gate|moe|swiglu|attn_gate|sigmoid_bias|qk_prepare|gather_rows|logit_scale|confidence_features|markov_logits)' \
  --section SpeedOfLight --section Occupancy --section LaunchStats \
  -o "$OUT/dspark_kernels" -f "$PY" profiling/session_workload.py --backend cuda --requests 4 --tokens 64
"$NCU_BIN" --import "$OUT/dspark_kernels.ncu-rep" --page details --csv > "$OUT/ncu_kernels.csv"
echo "wrote $OUT/dspark_kernels.ncu-rep and $OUT/ncu_kernels.csv"
