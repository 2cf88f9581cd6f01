#!/usr/bin/env bash
# The wheels the GPU machine's image lacks, for its Python (3.12, x86-64 manylinux), downloaded here
# into profiling/wheels/ (git-ignored). gpu_check.sh installs them from there with --no-index: the
# GPU machine reaches no package registry.
#
#   bash profiling/gpu_wheels.sh [EXTRA_PACKAGE ...]
#
# Default: nvtx (NVTX ranges; the image has only the nvidia-nvtx C library) and scipy (statistical
# tests). Each is fetched without its dependencies: name every one the image lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=profiling/wheels
PKGS=(nvtx scipy "$@")
VER=${GPU_PYTHON:-3.12}
mkdir -p "$DEST"
"$PY" -m pip download --only-binary=:all: --no-deps --python-version "$VER" --implementation cp \
  --abi "cp${VER/./}" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" "${PKGS[@]}"
ls -l "$DEST"
