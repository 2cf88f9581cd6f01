"""The `cuda` executor: the csrc/ kernels on a GPU through CuPy, one module per kernel family.

Each family is compiled by dspark itself (dspark.toolchain.family_cubin: NVRTC with dspark's
options, for the device's architecture, cached under a key covering every included header) and
loaded with `cupy.RawModule(path=...)`. CuPy's own compile path is not used: it adds -ftz=true
and keys its cache without the headers, so the binary that ran would not be the one the compile
tests and profiling/ptxas_report.md describe.

Kernel signatures come from the sources themselves (kernel_sources.scan, which preprocesses them
in Python), so a GPU machine needs neither a simt build nor a host compiler.
"""

from __future__ import annotations

import numpy as np

from .. import profile
from ..dtypes import dtype_supported  # noqa: F401  (its home was here: callers may still import it from here)
from ..errors import KernelArgumentError
from ..kernel_sources import Signature, csrc_dir, scan
from ..toolchain import Cubin, Nvrtc, family_cubin
from .launch import check_args, check_launch


def source_signatures() -> dict[str, Signature]:
    """name -> Signature read from csrc/ by dspark's own preprocessor (no host compiler needed)."""
    return scan(csrc_dir())


def device_arch(cupy) -> str:
    """sm_XY of the current device."""
    return f"sm_{cupy.cuda.Device().compute_capability}"


class CudaKernel:
    def __init__(self, raw, sig: Signature, array_type, executor):
        self._raw = raw
        self._array_type = array_type
        self._executor = executor
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
        if self._executor.recording is not None:  # validated once: a recorded pass replays the raw call
            self._executor.recording.append((self._raw, g, b, args, smem, self.name))
        self._raw(g, b, args, shared_mem=smem)


class CudaExecutor:
    """get_function(name) -> a kernel with CuPy's RawKernel convention. `cupy` is the array
    module (the real one, or a stand-in with its surface); `arch` defaults to the device's;
    `nvrtc` compiles the cubins (default: dspark.toolchain.find_nvrtc's choice)."""
    name = "cuda"

    def __init__(self, cupy=None, arch: str | None = None, nvrtc: Nvrtc | None = None):
        if cupy is None:
            import cupy
        self._cupy = cupy
        self.arch = arch or device_arch(cupy)
        self.nvrtc = nvrtc
        self.signatures = source_signatures()
        self.cubins: dict[str, Cubin] = {}
        self._modules: dict[str, object] = {}
        self._cache: dict[str, CudaKernel] = {}
        self.recording: list | None = None  # launches go here too while a pass is recorded (dspark.graphs)

    def module(self, source: str):
        """The RawModule of csrc/<source>, loaded from dspark's own cubin."""
        if source not in self._modules:
            cubin = family_cubin(csrc_dir() / source, self.arch, self.nvrtc)
            self._modules[source] = self._cupy.RawModule(path=str(cubin.path))
            self.cubins[source] = cubin
        return self._modules[source]

    def get_function(self, name: str) -> CudaKernel:
        if name not in self._cache:
            sig = self.signatures.get(name)
            if sig is None:
                raise KernelArgumentError(f"no kernel named {name!r} in csrc/")
            self._cache[name] = CudaKernel(self.module(sig.source).get_function(name), sig, self._cupy.ndarray, self)
        return self._cache[name]
