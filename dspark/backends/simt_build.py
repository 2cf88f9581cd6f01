"""The AddressSanitizer build of dspark._simt, made on demand for out-of-bounds hunting.

    env = asan_env()            # builds once into the cache, returns the environment to use
    subprocess.run([sys.executable, "script.py"], env=env)

The child process preloads libasan and loads the instrumented module instead of the normal
one; an out-of-bounds access in any kernel then aborts with ASan's report.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sysconfig
from pathlib import Path

from ..kernel_sources import SIMT_CXXFLAGS, csrc_dir, simt_sources

ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1"]
MODULE_ENV = "DSPARK_SIMT_ASAN_MODULE"


def cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def build_asan_module() -> Path:
    """Compile the instrumented module (once per source state) and return its path."""
    import pybind11

    root = csrc_dir()
    out_dir = cache_dir() / "simt-asan"
    sources = simt_sources(out_dir / "gen", root)
    digest = hashlib.sha256()
    for f in sorted(root.rglob("*")) + sources:
        if f.is_file():
            digest.update(f.name.encode() + f.read_bytes())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    target = out_dir / digest.hexdigest()[:16] / f"_simt{suffix}"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        cmd = [compiler(), *SIMT_CXXFLAGS, *ASAN_FLAGS, "-shared", "-fPIC",
               "-I", str(root), "-I", pybind11.get_include(), "-I", sysconfig.get_paths()["include"],
               *map(str, sources), "-o", str(target)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return target


def asan_env(base: dict | None = None) -> dict:
    """Environment for a child process that runs the simt backend under AddressSanitizer."""
    env = dict(os.environ if base is None else base)
    lib = subprocess.run([compiler(), "-print-file-name=libasan.so"], check=True, capture_output=True,
                         text=True).stdout.strip()
    env.update({
        "DSPARK_SIMT_ASAN": "1",
        MODULE_ENV: str(build_asan_module()),
        "LD_PRELOAD": lib,
        # Python itself "leaks" at exit by design; only memory errors matter here.
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1",
    })
    return env


def load_asan_module():
    path = os.environ.get(MODULE_ENV)
    if not path:
        raise ImportError(f"DSPARK_SIMT_ASAN=1 needs {MODULE_ENV}: run the process with asan_env()")
    spec = importlib.util.spec_from_file_location("_simt", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
