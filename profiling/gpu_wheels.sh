#!/usr/bin/env bash
# The wheels the GPU machine's image lacks, for its Python and platform (profiling/gpu_image.toml:
# `carry`, `python`, `platforms`), downloaded here into profiling/wheels/ (git-ignored).
# profiling/gpu_check.py installs them from there with --no-index (the GPU machine reaches no
# package registry) and, in a dry run, checks they are for that Python and cover every import the
# check makes that the image lacks.
#
#   bash profiling/gpu_wheels.sh [EXTRA_PACKAGE ...]
#
# Each is fetched without its dependencies: name every one the image lacks in `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=profiling/wheels
spec() { "$PY" -c "import tomllib; s = tomllib.load(open('profiling/gpu_image.toml', 'rb')); print($1)"; }
VER=$(spec 's["python"]')
read -r -a PLATFORMS <<< "$(spec '" ".join("--platform " + p for p in s["platforms"])')"
read -r -a CARRY <<< "$(spec '" ".join(s["carry"])')"
mkdir -p "$DEST"
"$PY" -m pip download --only-binary=:all: --no-deps --python-version "$VER" --implementation cp \
  --abi "cp${VER/./}" "${PLATFORMS[@]}" -d "$DEST" "${CARRY[@]}" "$@"
ls -l "$DEST"
