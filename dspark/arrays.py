"""Arrays from any framework, without copies.

Ops and sessions take CuPy arrays and any array that exposes `__cuda_array_interface__` or
DLPack (torch, JAX, Numba, ...) on the `cuda` backend, and NumPy arrays and anything that exposes
`__array_interface__` or DLPack (torch CPU tensors, ...) on every backend. `adopt` turns each
into the backend's own array type sharing the same memory: CuPy for device memory, NumPy for host
memory. Shape, dtype, strides and read-only come from those interfaces, never from NumPy-only
attributes (CuPy's `flags` has no `writeable`): `readonly(a)` reads the interface's flag.

    q, out = adopt(be, q=torch_q, out=torch_out, writes=("out",))
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np

from .errors import DTypeError, KernelArgumentError

# DLPack device types (dlpack.h)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DLPACK_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY


def _interface(a) -> dict | None:
    """The array's own description of its memory: CUDA array interface, else array interface."""
    for name in ("__cuda_array_interface__", "__array_interface__"):
        try:
            return getattr(a, name)
        except AttributeError:  # torch raises it for the interface of the other device
            continue
    return None


def readonly(a) -> bool:
    """Whether the array's interface marks its memory read-only (data = (pointer, read-only))."""
    iface = _interface(a)
    return bool(iface is not None and iface.get("data") and iface["data"][1])


def _dlpack_readonly(obj) -> bool:
    """The read-only bit of a DLPack 1.x export (a DLPack 0.x producer has none: writable)."""
    try:
        capsule = obj.__dlpack__(max_version=(1, 0))
    except TypeError:
        return False
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    is_valid = ctypes.pythonapi.PyCapsule_IsValid
    is_valid.restype, is_valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    if not is_valid(capsule, b"dltensor_versioned"):
        return False
    # DLManagedTensorVersioned: {u32 major, u32 minor}, manager_ctx*, deleter*, u64 flags, DLTensor
    flags = ctypes.c_uint64.from_address(get(capsule, b"dltensor_versioned") + 24).value
    return bool(flags & _DLPACK_READ_ONLY)


def _device_type(obj) -> int | None:
    try:
        return int(obj.__dlpack_device__()[0])
    except (AttributeError, TypeError):
        return None


def as_array(be, obj, what: str, *, writable: bool = False):
    """`obj` as an array of backend `be` sharing its memory: a CuPy array for device memory (cuda
    only), a NumPy array for host memory; other objects (lists, scalars, None) are returned as
    they are, for the op's own checks. `writable`: the op writes it, so a read-only interface is
    refused."""
    if obj is None or isinstance(obj, (int, float, bool, np.generic, str)):
        return obj
    xp = be.xp
    if isinstance(obj, np.ndarray) or (xp is not np and isinstance(obj, xp.ndarray)):
        arr, ro = obj, (lambda: readonly(obj))
    elif "__cuda_array_interface__" in _interface_names(obj):
        _need_device(be, obj, what)
        arr, ro = xp.asarray(obj), (lambda: readonly(obj))  # CuPy wraps the pointer, no copy
    elif hasattr(obj, "__dlpack__") and _device_type(obj) in (_DL_CUDA, _DL_CUDA_MANAGED):
        _need_device(be, obj, what)
        arr, ro = xp.from_dlpack(obj), (lambda: _dlpack_readonly(obj))
    elif hasattr(obj, "__dlpack__") and _device_type(obj) in (_DL_CPU, _DL_CUDA_HOST):
        arr = np.from_dlpack(obj)  # NumPy keeps a DLPack 1.x read-only bit in its interface
        ro = (lambda: readonly(arr))
    elif "__array_interface__" in _interface_names(obj):
        arr = np.asarray(obj)  # shares the memory the interface describes
        ro = (lambda: readonly(obj))
    else:
        return obj
    if writable and ro():
        raise KernelArgumentError(f"{what} is read-only (its array interface says so): the op writes it")
    return arr


def _interface_names(obj) -> tuple[str, ...]:
    names = []
    for name in ("__cuda_array_interface__", "__array_interface__"):
        try:
            getattr(obj, name)
            names.append(name)
        except AttributeError:
            continue
    return tuple(names)


def _need_device(be, obj, what: str) -> None:
    if be.name != "cuda":
        raise DTypeError(f"{what} is a {type(obj).__module__}.{type(obj).__name__} in GPU memory: the "
                         f"{be.name} backend takes host arrays (NumPy, __array_interface__ or CPU DLPack)")


def _convert(be, obj, what: str, writable: bool, host: bool):
    if isinstance(obj, (list, tuple)):  # per-session caches, per-layer lists of them
        return [_convert(be, x, f"{what}[{i}]", writable, host) for i, x in enumerate(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # Filters, Streams: arrays per field
        return dataclasses.replace(obj, **{f.name: _convert(be, getattr(obj, f.name), f"{what}.{f.name}", writable,
                                                            host) for f in dataclasses.fields(obj)})
    return host_array(be, obj, what) if host else as_array(be, obj, what, writable=writable)


def adopt(be, writes: tuple[str, ...] = (), host: tuple[str, ...] = (), **named):
    """as_array for each keyword argument, in order; lists (of lists) of arrays, and dataclasses
    of arrays, are converted entry by entry. Names in `writes` are written by the op; names in
    `host` are read on the host (a device array is copied there). Returns the converted values as
    a tuple (the value itself when one is given)."""
    out = [_convert(be, obj, name, name in writes, name in host) for name, obj in named.items()]
    return out[0] if len(out) == 1 else tuple(out)


def host_array(be, obj, what: str):
    """A host view of `obj` for host-side checks (token ids): a device array is copied to the host."""
    arr = as_array(be, obj, what)
    if be.xp is not np and isinstance(arr, be.xp.ndarray):
        return be.to_host(arr)
    return arr
