#!/usr/bin/env bash
# The GPU check (profiling/gpu_check.py says what it runs and how each step is judged):
#
#   bash profiling/gpu_wheels.sh            here, beforehand: the wheels the GPU image lacks, for its
#                                           Python 3.12, into profiling/wheels/ (git-ignored)
#   bash profiling/gpu_check.sh OUTDIR      on the GPU machine: writes OUTDIR/gpu_report.md step by step
#   bash profiling/gpu_check.sh --dry-run [OUTDIR]
#                                           anywhere: every step that can run without a GPU (CI runs it)
#   bash profiling/gpu_check.sh --only bench,gate OUTDIR
#                                           some steps again
# Exit code 1 if any step failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" profiling/gpu_check.py "$@"
