"""Arrays from any framework, without copies.

Ops and sessions take CuPy arrays and any array that exposes `__cuda_array_interface__` or
DLPack (torch, JAX, Numba, ...) on the `cuda` backend, and NumPy arrays and anything that exposes
`__array_interface__` or DLPack (torch CPU tensors, ...) on every backend. `adopt` turns each
into the backend's own array type sharing the same memory: CuPy for device memory, NumPy for host
memory. Shape, dtype, strides and read-only come from those interfaces, never from NumPy-only
attributes (CuPy's `flags` has no `writeable`): `readonly(a)` reads the interface's flag.

    q, out = adopt(be, q=torch_q, out=torch_out, writes=("out",))

Dtypes survive the trip: DLPack is taken first wherever the producer offers it, because it names
bfloat16 (kDLBfloat) where the array interfaces cannot: their typestr for bfloat16 is `<V2`, an
anonymous 2-byte void (torch, JAX and ml_dtypes all write it). NumPy cannot import a bfloat16
DLPack capsule, so dspark reads the capsule itself (`dlpack_view`). A `<V2` array interface is
read as bfloat16 only from producers known to mean it (BF16_V2_PRODUCERS); from anyone else it is
refused with a DTypeError naming the argument.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np

from .dtypes import BF16
from .errors import DTypeError, KernelArgumentError

# DLPack device types (dlpack.h)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DLPACK_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY
# DLDataType codes (dlpack.h): kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLBool
_DL_KINDS = {0: "i", 1: "u", 2: "f", 4: "bfloat", 6: "b"}
# Libraries whose __cuda_array_interface__ / __array_interface__ typestr "<V2" means bfloat16 (they
# write ml_dtypes.bfloat16's own typestr for it): the top-level module of the array's type.
BF16_V2_PRODUCERS = ("torch", "jax", "jaxlib", "cupy", "ml_dtypes")


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


# ---- DLPack, read by dspark: bfloat16 included ----------------------------------------------------------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


def _capsule_tensor(capsule) -> tuple[_DLTensor, bool]:
    """(the DLTensor, read-only) inside a DLPack capsule, legacy or versioned (1.x)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    is_valid = ctypes.pythonapi.PyCapsule_IsValid
    is_valid.restype, is_valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    if is_valid(capsule, b"dltensor_versioned"):
        # DLManagedTensorVersioned: {u32 major, u32 minor}, manager_ctx*, deleter*, u64 flags, DLTensor
        at = get(capsule, b"dltensor_versioned")
        flags = ctypes.c_uint64.from_address(at + 24).value
        return _DLTensor.from_address(at + 32), bool(flags & _DLPACK_READ_ONLY)
    if is_valid(capsule, b"dltensor"):
        return _DLTensor.from_address(get(capsule, b"dltensor")), False  # DLManagedTensor: DLTensor first
    raise BufferError("not a DLPack capsule")


def _export(obj):
    try:
        return obj.__dlpack__(max_version=(1, 0))
    except TypeError:  # a DLPack 0.x producer
        return obj.__dlpack__()


def dlpack_view(obj) -> np.ndarray:
    """A NumPy array over the memory `obj`'s DLPack export describes (for host memory; the CuPy
    stand-in's device memory is host memory too), any dtype DLPack names that NumPy holds,
    bfloat16 included (as ml_dtypes.bfloat16). The capsule stays alive, unconsumed, as the
    array's base, so the producer frees the memory only when the array is gone."""
    capsule = _export(obj)
    t, ro = _capsule_tensor(capsule)
    kind = _DL_KINDS.get(t.dtype.code)
    if kind is None or t.dtype.lanes != 1:
        raise DTypeError(f"DLPack dtype code {t.dtype.code} ({t.dtype.bits} bits x {t.dtype.lanes}) has no NumPy dtype")
    if kind == "bfloat":
        if t.dtype.bits != 16:
            raise DTypeError(f"DLPack bfloat of {t.dtype.bits} bits: only bfloat16 is served")
        storage, dtype = "<u2", BF16
    else:
        storage = f"|b1" if kind == "b" else f"<{kind}{t.dtype.bits // 8}"
        dtype = np.dtype(storage)
    size = t.dtype.bits // 8
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] * size for i in range(t.ndim)) if t.strides else None

    class _Holder:
        owner = capsule  # kept alive with the array: its destructor calls the producer's deleter
        __array_interface__ = {"shape": shape, "typestr": storage, "strides": strides, "version": 3,
                               "data": ((t.data or 0) + t.byte_offset, ro)}
    return np.asarray(_Holder()).view(dtype)


def v2_means_bf16(obj) -> bool:
    """Whether obj's producer writes bfloat16 as the typestr "<V2" (BF16_V2_PRODUCERS)."""
    return type(obj).__module__.partition(".")[0] in BF16_V2_PRODUCERS


def _void_typestr(obj, iface: dict, what: str) -> bool:
    """True when the interface says "<V2" and the producer means bfloat16 by it; DTypeError for
    any other void type, or a "<V2" from a producer not known to mean bfloat16."""
    typestr = iface.get("typestr", "")
    if typestr[1:2] != "V":
        return False
    if typestr[2:] == "2" and v2_means_bf16(obj):
        return True
    producer = f"{type(obj).__module__}.{type(obj).__name__}"
    raise DTypeError(f"{what} is a {producer} whose array interface says typestr {typestr!r}: a {typestr[2:]}-byte "
                     "type the interface cannot name (bfloat16 is written so, but so is any other). Pass it through "
                     "DLPack, which names bfloat16, or as a float32/float16/bfloat16 array")


class _Retyped:
    """An array interface with another typestr over the same memory (bfloat16 read as uint16, to
    be viewed as bfloat16): the original object stays alive through it."""

    def __init__(self, obj, name: str, typestr: str):
        self.owner = obj
        setattr(self, name, dict(getattr(obj, name), typestr=typestr, descr=[("", typestr)]))


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
    names = _interface_names(obj)
    device = _device_type(obj) if hasattr(obj, "__dlpack__") else None
    if isinstance(obj, np.ndarray) or (xp is not np and isinstance(obj, xp.ndarray)):
        arr, ro = obj, (lambda: readonly(obj))
    elif device in (_DL_CUDA, _DL_CUDA_MANAGED):  # DLPack first: it names bfloat16
        _need_device(be, obj, what)
        arr, ro = xp.from_dlpack(obj), (lambda: _dlpack_readonly(obj))
    elif "__cuda_array_interface__" in names:
        _need_device(be, obj, what)
        if _void_typestr(obj, obj.__cuda_array_interface__, what):
            arr = _as_bf16(be, xp.asarray(_Retyped(obj, "__cuda_array_interface__", "<u2")), what)
        else:
            arr = xp.asarray(obj)  # CuPy wraps the pointer, no copy
        ro = (lambda: readonly(obj))
    elif device in (_DL_CPU, _DL_CUDA_HOST):
        try:
            arr = np.from_dlpack(obj)  # NumPy keeps a DLPack 1.x read-only bit in its interface
        except (BufferError, RuntimeError, TypeError):  # a dtype NumPy cannot import: bfloat16
            arr = dlpack_view(obj)
        ro = (lambda: readonly(arr))
    elif "__array_interface__" in names:
        if _void_typestr(obj, obj.__array_interface__, what):
            arr = np.asarray(_Retyped(obj, "__array_interface__", "<u2")).view(BF16)
        else:
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


def _as_bf16(be, arr, what: str):
    """A uint16 device array viewed as bfloat16, or DTypeError where this CuPy has no bfloat16."""
    try:
        return arr.view(BF16)
    except (TypeError, ValueError) as e:
        raise DTypeError(f"{what} is bfloat16, which CuPy {getattr(be.xp, '__version__', '?')} cannot hold "
                         "(CuPy >= 14 with ml_dtypes can)") from e


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
