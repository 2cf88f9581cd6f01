"""Out-of-tree builds of dspark._simt: the AddressSanitizer build, and private builds of a
subset of kernel families (for working on one family while others are mid-edit).

    env = asan_env()            # builds once into the cache, returns the environment to use
    subprocess.run([sys.executable, "script.py"], env=env)

    python -m dspark.backends.simt_build --families argmax attention   # prints the env line

A process with DSPARK_SIMT_MODULE=<path> loads that build instead of the installed module; with
DSPARK_SIMT_ASAN=1 it must also preload libasan (asan_env does both).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

from ..kernel_sources import SIMT_CXXFLAGS, cache_dir, csrc_dir, kernel_files, scan, simt_sources, write_json

ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1"]
MODULE_ENV = "DSPARK_SIMT_MODULE"


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def build_module(asan: bool = False, families: list[str] | None = None) -> Path:
    """Compile the module (once per source state) into the cache and return its path. A
    `_kernels.json` for exactly the compiled families is written beside it."""
    import pybind11

    root = csrc_dir()
    files = [f for f in kernel_files(root) if families is None or f.stem in families]
    if families is not None and len(files) != len(set(families)):
        raise ValueError(f"families={families}: expected names of csrc/*.cu files")
    digest = hashlib.sha256(repr((asan, [f.name for f in files])).encode())
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.suffix in (".h", ".cuh", ".cpp") or f in files:
            digest.update(f.name.encode() + f.read_bytes())
    out_dir = cache_dir() / "simt-builds" / digest.hexdigest()[:16]
    target = out_dir / f"_simt{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    if not target.exists():
        # Built in a folder of this process's and renamed into place: two processes building the same
        # module at once (parallel test workers) each finish their own, and no one reads half a file.
        stage = out_dir.with_name(f"{out_dir.name}.{os.getpid()}.tmp")
        shutil.rmtree(stage, ignore_errors=True)
        sources = simt_sources(stage / "gen", root, files)
        write_json(scan(root, files), stage / "_kernels.json")
        flags = [*SIMT_CXXFLAGS, *(ASAN_FLAGS if asan else [])]
        cmd = [compiler(), *flags, "-shared", "-fPIC", "-I", str(root), "-I", pybind11.get_include(),
               "-I", sysconfig.get_paths()["include"], *map(str, sources), "-o", str(stage / target.name)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        try:
            os.replace(stage, out_dir)
        except OSError:  # another process put the same build there first
            shutil.rmtree(stage, ignore_errors=True)
    return target


def asan_env(base: dict | None = None, families: list[str] | None = None) -> dict:
    """Environment for a child process that runs the simt backend under AddressSanitizer."""
    env = dict(os.environ if base is None else base)
    lib = subprocess.run([compiler(), "-print-file-name=libasan.so"], check=True, capture_output=True,
                         text=True).stdout.strip()
    env.update({
        "DSPARK_SIMT_ASAN": "1",
        MODULE_ENV: str(build_module(asan=True, families=families)),
        "LD_PRELOAD": lib,
        # Python itself "leaks" at exit by design; only memory errors matter here.
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1",
    })
    return env


def load_module_at(path: str):
    spec = importlib.util.spec_from_file_location("_simt", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="*", help="csrc/<family>.cu stems to compile (default: all)")
    ap.add_argument("--asan", action="store_true")
    a = ap.parse_args(argv)
    print(f"{MODULE_ENV}={build_module(asan=a.asan, families=a.families)}")


if __name__ == "__main__":
    main()
