"""The `cuda` executor: the same csrc/ sources through cupy.RawModule (NVRTC, the device's
arch), one module per kernel family, compiled on first use and cached by CuPy."""

from __future__ import annotations

import numpy as np

from ..errors import KernelArgumentError
from ..kernel_sources import Signature, csrc_dir, load_json
from .launch import check_args, check_launch

NVRTC_OPTIONS = ("-std=c++17",)


class CudaKernel:
    def __init__(self, raw, sig: Signature):
        self._raw = raw
        self.signature = sig
        self.name = sig.name

    def __call__(self, grid, block, args, shared_mem=0):
        import cupy
        g, b, smem = check_launch(self.signature, grid, block, args, shared_mem)
        check_args(self.signature, args, cupy.ndarray)
        if smem > 48 * 1024 and self._raw.max_dynamic_shared_size_bytes < smem:
            self._raw.max_dynamic_shared_size_bytes = smem
        # CuPy would turn None into 0xffffffff, not NULL: pass a null pointer explicitly.
        args = tuple(np.uint64(0) if a is None else a for a in args)
        self._raw(g, b, args, shared_mem=smem)


class CudaExecutor:
    name = "cuda"

    def __init__(self):
        import cupy
        self._cupy = cupy
        self.signatures = load_json()
        self._modules: dict[str, object] = {}
        self._cache: dict[str, CudaKernel] = {}

    def module(self, source: str):
        if source not in self._modules:
            root = csrc_dir()
            code = (root / source).read_text()
            opts = NVRTC_OPTIONS + (f"-I{root}",)
            self._modules[source] = self._cupy.RawModule(code=code, options=opts)
        return self._modules[source]

    def get_function(self, name: str) -> CudaKernel:
        if name not in self._cache:
            sig = self.signatures.get(name)
            if sig is None:
                raise KernelArgumentError(f"no kernel named {name!r} in csrc/")
            self._cache[name] = CudaKernel(self.module(sig.source).get_function(name), sig)
        return self._cache[name]
