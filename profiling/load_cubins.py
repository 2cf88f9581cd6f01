"""Compile and load every kernel family: dspark's own cubins (dspark.toolchain.family_cubin), loaded
by path as the `cuda` backend loads them, every entry point looked up by name.

    python profiling/load_cubins.py                      # this machine's GPU, through CuPy
    python profiling/load_cubins.py --contract           # no GPU: sm_90 on the CuPy contract stand-in
    python profiling/load_cubins.py --contract --nvrtc 12 13   # each NVRTC major found here, in turn
    python profiling/load_cubins.py --jobs 8             # families compiled 8 at a time
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from dspark.backends import contract
from dspark.backends.cuda import CudaExecutor
from dspark.kernel_sources import kernel_files
from dspark.toolchain import default_nvrtc, family_cubin, find_nvrtc


def compile_all(ex: CudaExecutor, jobs: int) -> None:
    """Build every family's cubin for the executor's arch, `jobs` NVRTC compiles at a time (each
    family is one compile; NVRTC programs are independent, so threads overlap them)."""
    nvrtc = ex.nvrtc or default_nvrtc()
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(lambda f: family_cubin(f, ex.arch, nvrtc), kernel_files()))


def load_all(ex: CudaExecutor) -> list[str]:
    """Load every family's module and every entry point of it; one line per family."""
    lines = []
    for f in kernel_files():
        t = time.perf_counter()
        ex.module(f.name)
        c = ex.cubins[f.name]
        names = sorted(n for n, s in ex.signatures.items() if s.source == f.name)
        for n in names:
            ex.get_function(n)
        lines.append(f"  {f.name}: {len(names)} kernels, cubin {c.path.stat().st_size} bytes, key {c.key[:12]}, "
                     f"loaded in {time.perf_counter() - t:.2f}s")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contract", action="store_true", help="no GPU: load through the CuPy contract stand-in")
    ap.add_argument("--arch", default="sm_90", help="with --contract: the architecture to build for")
    ap.add_argument("--nvrtc", nargs="+", type=int, metavar="MAJOR",
                    help="compile with the NVRTC of each of these major versions (default: dspark's choice)")
    ap.add_argument("--jobs", type=int, default=1, help="families compiled at once (default 1)")
    a = ap.parse_args(argv)
    for nv in [find_nvrtc(m) for m in a.nvrtc] if a.nvrtc else [default_nvrtc()]:
        if a.contract:
            ex = contract.backend(a.arch, nvrtc=nv).kernels
        else:
            ex = CudaExecutor(nvrtc=nv)
        print(f"arch {ex.arch}, NVRTC {nv.version[0]}.{nv.version[1]} ({nv.path}), "
              f"{len(ex.signatures)} entry points read from the sources"
              f"{' (CuPy contract stand-in)' if a.contract else ''}", flush=True)
        t = time.perf_counter()
        compile_all(ex, a.jobs)
        print(f"  compiled (or found cached) in {time.perf_counter() - t:.1f}s, {a.jobs} at a time", flush=True)
        print("\n".join(load_all(ex)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
