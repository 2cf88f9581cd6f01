"""Compile and load every kernel family: dspark's own cubins (dspark.toolchain.family_cubin), loaded
by path as the `cuda` backend loads them, every entry point looked up by name.

    python profiling/load_cubins.py                      # this machine's GPU, through CuPy
    python profiling/load_cubins.py --contract           # no GPU: sm_90 on the CuPy contract stand-in
    python profiling/load_cubins.py --contract --nvrtc 12 13   # each NVRTC major found here, in turn
"""

from __future__ import annotations

import argparse
import sys
import time

from dspark.backends import contract
from dspark.backends.cuda import CudaExecutor
from dspark.kernel_sources import kernel_files
from dspark.toolchain import default_nvrtc, find_nvrtc


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
    a = ap.parse_args(argv)
    for nv in [find_nvrtc(m) for m in a.nvrtc] if a.nvrtc else [default_nvrtc()]:
        if a.contract:
            ex = contract.backend(a.arch, nvrtc=nv).kernels
        else:
            ex = CudaExecutor(nvrtc=nv)
        print(f"arch {ex.arch}, NVRTC {nv.version[0]}.{nv.version[1]} ({nv.path}), "
              f"{len(ex.signatures)} entry points read from the sources"
              f"{' (CuPy contract stand-in)' if a.contract else ''}")
        print("\n".join(load_all(ex)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
