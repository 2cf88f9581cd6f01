"""Three backends, one launch plan: `numpy` (the reference), `simt` (the real kernels on the
CPU) and `cuda` (the same kernels on a GPU through CuPy)."""

from __future__ import annotations

import functools
import os
import sys
import types
from dataclasses import dataclass, field

import numpy as np

from ..errors import BackendUnavailable
from .allocator import Allocator

NAMES = ("numpy", "simt", "cuda")


@dataclass
class Backend:
    name: str
    xp: object                   # the array module: numpy or cupy
    kernels: object | None       # executor with get_function(name); None on numpy
    alloc: Allocator = field(repr=False, default=None)
    cost: object = field(repr=False, default=None, compare=False)  # dspark.cost.cost_model(self), made on first use

    def __post_init__(self):
        if self.alloc is None:
            self.alloc = Allocator(self.xp)

    def asarray(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return a.get() if hasattr(a, "get") else np.asarray(a)

    def fetch(self, *arrays) -> list[np.ndarray]:
        """Host copies of several arrays in ONE device->host copy: on a GPU their bytes are packed
        side by side on the device, copied once (one wait on the device) and split again. The
        round's two synchronisations go through here. Host arrays pass through as they are."""
        dev = [i for i, a in enumerate(arrays) if not isinstance(a, np.ndarray)]
        out = [np.asarray(a) if isinstance(a, np.ndarray) else None for a in arrays]
        if not dev:
            return out
        if self.xp is np:
            for i in dev:
                out[i] = np.asarray(arrays[i])
            return out
        xp = self.xp
        packed = xp.concatenate([xp.ascontiguousarray(arrays[i]).reshape(-1).view(xp.uint8) for i in dev])
        host, at = self.to_host(packed), 0
        for i in dev:
            a = arrays[i]
            n = int(a.size) * a.dtype.itemsize
            out[i] = host[at : at + n].view(a.dtype).reshape(a.shape)
            at += n
        return out

    def synchronize(self) -> None:
        """Wait for every launched kernel (a no-op on the CPU backends, which run synchronously)."""
        if self.name == "cuda":
            self.xp.cuda.Device().synchronize()

    def address(self, a) -> int:
        """The address of an array's first element (0 for None), as kernels see it."""
        if a is None:
            return 0
        return int(a.data.ptr) if self.name == "cuda" else int(a.ctypes.data)

    def free_bytes(self) -> int:
        """Bytes a new allocation can still take: the device's free memory plus what CuPy's pool
        holds unused (cuda), the host's available memory (numpy, simt)."""
        if self.name == "cuda":
            free, _ = self.xp.cuda.runtime.memGetInfo()
            return int(free) + int(self.xp.get_default_memory_pool().free_bytes())
        return host_available()

    def pointer_table(self, arrays) -> object:
        """A uint64 array of element addresses, for `const T* const*` kernel parameters. The
        caller keeps `arrays` alive for as long as the table is used."""
        return self.xp.asarray(np.array([self.address(a) for a in arrays], dtype=np.uint64))


def host_available() -> int:
    """The host memory a process can still allocate: MemAvailable of /proc/meminfo (Linux), else
    the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # no way to tell: refuse nothing


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device: all mean "no GPU here"
        return False


@functools.lru_cache(maxsize=None)
def simt_available() -> bool:
    try:
        from .simt import load_module
        load_module()
        return True
    except ImportError:
        return False


_ARRAY_MODULES: dict[type, object] = {}


def register_array_module(array_type: type, module) -> None:
    """Make array_module() return `module` for arrays of `array_type` (the CuPy contract stand-in)."""
    _ARRAY_MODULES[array_type] = module


def array_module(a):
    """numpy for NumPy arrays, cupy for CuPy arrays (or the module registered for the type)."""
    if isinstance(a, np.ndarray):
        return np
    for t, m in _ARRAY_MODULES.items():
        if isinstance(a, t):
            return m
    import cupy
    return cupy.get_array_module(a)


def backends() -> list[str]:
    """The backends that work here, in order: numpy always, simt where dspark._simt is built, cuda where
    CuPy finds a GPU (also `dspark.backends()`)."""
    out = ["numpy"]
    if simt_available():
        out.append("simt")
    if cuda_available():
        out.append("cuda")
    return out


@functools.lru_cache(maxsize=None)
def _make(name: str) -> Backend:
    if name == "numpy":
        return Backend("numpy", np, None)
    if name == "simt":
        if not simt_available():
            raise BackendUnavailable("backend 'simt' needs the compiled dspark._simt module: pip install -e .")
        from .simt import SimtExecutor
        return Backend("simt", np, SimtExecutor())
    if not cuda_available():
        raise BackendUnavailable("backend 'cuda' needs CuPy and a working GPU: pip install 'dspark[cuda12]'")
    import cupy

    from .cuda import CudaExecutor
    if os.environ.get("DSPARK_CUDA_POOL") == "0":  # one cudaMalloc per array: compute-sanitizer sees every bound
        cupy.cuda.set_allocator(None)
    return Backend("cuda", cupy, CudaExecutor())


def get_backend(name: str | None = None) -> Backend:
    """The named backend, or the default: `cuda` when a GPU works, else `numpy`."""
    if name is None:
        name = "cuda" if cuda_available() else "numpy"
    if name not in NAMES:
        raise ValueError(f"backend={name!r}: expected one of {', '.join(NAMES)}")
    return _make(name)


class _PackageListingBackends(types.ModuleType):
    """`dspark.backends()` lists the available backends (the documented API) while
    `dspark.backends` stays this package, so `import dspark.backends.simt as s` still resolves:
    a plain function of that name on `dspark` would hide the package."""

    def __call__(self) -> list[str]:
        return backends()


sys.modules[__name__].__class__ = _PackageListingBackends
