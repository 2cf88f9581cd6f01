"""The `cuda` executor: the csrc/ kernels on a GPU through CuPy, one module per kernel family.

Each family is compiled by dspark itself (dspark.toolchain.family_cubin: NVRTC with dspark's
options, for the device's architecture, cached under a key covering every included header) and
loaded with `cupy.RawModule(path=...)`. CuPy's own compile path is not used: it adds -ftz=true
and keys its cache without the headers, so the binary that ran would not be the one the compile
tests and profiling/ptxas_report.md describe.

Kernel signatures come from the sources themselves (kernel_sources.scan, cached by the sources'
bytes), so a GPU machine needs no simt build; dspark/_kernels.json is the fallback when no host
preprocessor is available.
"""

from __future__ import annotations

import hashlib
import os
import subprocess

import numpy as np

from .. import profile
from ..errors import KernelArgumentError
from ..kernel_sources import (SIGNATURES_JSON, Signature, cache_dir, csrc_dir, includes, kernel_files, load_json,
                              scan, write_json)
from ..toolchain import Cubin, family_cubin
from .launch import check_args, check_launch


def source_signatures() -> dict[str, Signature]:
    """name -> Signature scanned from csrc/ (cached under the hash of every source and header)."""
    root = csrc_dir()
    files = kernel_files(root)
    h = hashlib.sha256()
    for f in sorted({*files, *(i for f in files for i in includes(f))}):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    path = cache_dir() / "signatures" / f"{h.hexdigest()[:24]}.json"
    if path.is_file():
        return load_json(path)
    try:
        sigs = scan(root)
    except (OSError, subprocess.CalledProcessError) as e:  # no host preprocessor: the simt build's table
        if SIGNATURES_JSON.is_file():
            return load_json()
        raise KernelArgumentError(f"cannot read kernel signatures: preprocessing csrc/ failed ({e}) and "
                                  f"{SIGNATURES_JSON.name} is absent") from e
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write_json(sigs, tmp)
    os.replace(tmp, path)
    return sigs


def device_arch(cupy) -> str:
    """sm_XY of the current device."""
    return f"sm_{cupy.cuda.Device().compute_capability}"


def dtype_supported(cupy, dtype) -> bool:
    """Whether this CuPy can hold arrays of `dtype` (bfloat16 needs CuPy >= 14 with ml_dtypes):
    asked of CuPy's own type table, so no device is needed."""
    try:
        cupy._core._scalar.get_typename(np.dtype(dtype))
        return True
    except (KeyError, ValueError, TypeError):
        return False
    except AttributeError:  # a CuPy without that table: try an allocation
        try:
            cupy.empty(1, dtype)
            return True
        except Exception:  # TypeError or ValueError, depending on the version
            return False


class CudaKernel:
    def __init__(self, raw, sig: Signature, array_type):
        self._raw = raw
        self._array_type = array_type
        self.signature = sig
        self.name = sig.name

    def __call__(self, grid, block, args, shared_mem=0):
        g, b, smem = check_launch(self.signature, grid, block, args, shared_mem)
        check_args(self.signature, args, self._array_type)
        if smem > 48 * 1024 and self._raw.max_dynamic_shared_size_bytes < smem:
            self._raw.max_dynamic_shared_size_bytes = smem
        # CuPy would turn None into 0xffffffff, not NULL: pass a null pointer explicitly.
        args = tuple(np.uint64(0) if a is None else a for a in args)
        profile.record("launch", self.name)
        self._raw(g, b, args, shared_mem=smem)


class CudaExecutor:
    """get_function(name) -> a kernel with CuPy's RawKernel convention. `cupy` is the array
    module (the real one, or a stand-in with its surface); `arch` defaults to the device's."""
    name = "cuda"

    def __init__(self, cupy=None, arch: str | None = None):
        if cupy is None:
            import cupy
        self._cupy = cupy
        self.arch = arch or device_arch(cupy)
        self.signatures = source_signatures()
        self.cubins: dict[str, Cubin] = {}
        self._modules: dict[str, object] = {}
        self._cache: dict[str, CudaKernel] = {}

    def module(self, source: str):
        """The RawModule of csrc/<source>, loaded from dspark's own cubin."""
        if source not in self._modules:
            cubin = family_cubin(csrc_dir() / source, self.arch)
            self._modules[source] = self._cupy.RawModule(path=str(cubin.path))
            self.cubins[source] = cubin
        return self._modules[source]

    def get_function(self, name: str) -> CudaKernel:
        if name not in self._cache:
            sig = self.signatures.get(name)
            if sig is None:
                raise KernelArgumentError(f"no kernel named {name!r} in csrc/")
            self._cache[name] = CudaKernel(self.module(sig.source).get_function(name), sig, self._cupy.ndarray)
        return self._cache[name]


def main(argv=None) -> int:
    """Compile and load every kernel family for this machine's GPU (or, with --contract, for
    sm_90 on the CuPy contract stand-in) and print what was loaded."""
    import argparse
    import time

    from ..kernel_sources import kernel_files
    from ..toolchain import default_nvrtc
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--contract", action="store_true", help="no GPU: load through the CuPy contract stand-in")
    a = ap.parse_args(argv)
    if a.contract:
        from .contract import backend
        ex = backend("sm_90").kernels
    else:
        ex = CudaExecutor()
    nv = default_nvrtc()
    print(f"arch {ex.arch}, NVRTC {nv.version[0]}.{nv.version[1]} ({nv.path}), "
          f"{len(ex.signatures)} entry points scanned from the sources")
    for f in kernel_files():
        t = time.perf_counter()
        ex.module(f.name)
        c = ex.cubins[f.name]
        names = sorted(n for n, s in ex.signatures.items() if s.source == f.name)
        for n in names:
            ex.get_function(n)
        print(f"  {f.name}: {len(names)} kernels, cubin {c.path.stat().st_size} bytes, key {c.key[:12]}, "
              f"loaded in {time.perf_counter() - t:.2f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
