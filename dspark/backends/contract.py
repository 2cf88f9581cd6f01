"""The CuPy contract: a CPU stand-in for CuPy whose attribute surface is exactly the installed
CuPy's, so the whole `cuda` code path runs, and fails where CuPy would, on a machine with no GPU.

    be = contract.backend()             # dspark's `cuda` Backend, built on the stand-in
    with dspark.profile.counting() as c:
        session.round()                 # c.syncs, c.d2h, c.h2d, c.launches, c.array_ops, c.sites

* Surface: every attribute read on a device array, its `flags`, its `data` pointer, the memory
  pool, the `cupy` module, `cupy.cuda` and its Device, Stream and runtime is checked against the
  installed CuPy's classes and modules by introspection (`dir()`), never a hand-written list.
  A name CuPy lacks raises ContractError (an AttributeError), e.g. `flags.writeable` or `ctypes`.
* Like CuPy, it refuses implicit conversion between host and device: numpy.asarray(device array)
  raises TypeError, NumPy arrays mixed with device arrays in an expression or a function call
  raise TypeError, `dev[...] = numpy_array` raises ValueError (CuPy's fill refuses it). Python and
  NumPy scalars, and index arrays, are converted as CuPy converts them (an index array is a
  host->device copy, and is counted).
* Kernels: `RawModule(path=...)` loads the cubin dspark built (the bytes are kept in `loaded`),
  `get_function` finds the entry in its symbol table, and a launch runs the same kernel through
  simt on the arrays' buffers, with CuPy's argument convention (device arrays as pointers, NumPy
  scalars by value) and its launch limits (dynamic shared memory above 48 KiB needs
  max_dynamic_shared_size_bytes).
* Counts: every device->host copy (get, item, int(), bool(), repr...), host->device copy,
  synchronisation, array operation and graph launch is reported to dspark.profile counters, each
  copy and sync with the dspark source line that caused it.
* Streams and capture: `with stream:` makes a stream current. Between `stream.begin_capture()` and
  `stream.end_capture()` (never on the legacy default stream) the stand-in keeps CUDA's rules: a
  synchronisation, a device->host copy, a host->device copy from pageable memory, a memory-pool
  allocation or work on another stream raises CaptureError and invalidates the capture (CuPy's own
  pool may allocate during a relaxed-mode capture; the stand-in refuses it, because memory the
  pool hands a graph is handed out again once the array dies). Kernel launches and in-place array
  operations (ufuncs with out=, assignments, fills) are recorded, not run: `end_capture()` returns
  a Graph whose `launch()` runs them in order with the arguments packed at capture time on what
  the buffers hold at launch time, so a host value baked into a captured pass replays stale. A
  graph whose buffers were freed since its capture refuses to launch.
* Null memory: under `null_memory()` arrays are untouched anonymous mappings (shape, dtype and a
  pointer of their own, no memory); with `executing(False)` nothing writes them, so a pass over
  Qwen3.5-27B's real weights, caches and checkpoints runs its whole host path on any machine.
  `own_time()` accounts the time the stand-in spends inside CuPy's entry points (its Python stands
  where CuPy's Cython and the driver would be), so profiling/host_round.py can time dspark's own.

Device memory is host memory here, so a device pointer is a host address the simt kernels can
follow: pointer tables work as on a GPU. Arithmetic is NumPy's (CuPy follows NumPy's promotion
rules); the stand-in checks the contract, not CuPy's numerics.

A test double of the backends layer: it imports nothing above it (no session, model or worker).
`python profiling/round_counts.py` prints the per-round counts of greedy and sampled sessions.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import operator
import os
import struct
import time
import types
import weakref

import numpy as np

from .. import profile

import cupy as _cupy  # noqa: E402  (the installed CuPy: introspected for its surface, never run)
from cupy._core import flags as _cupy_flags  # noqa: E402


def _names(obj) -> frozenset:
    return frozenset(dir(obj))


SURFACE = {
    "cupy.ndarray": _names(_cupy.ndarray),
    "cupy.ndarray.flags": frozenset(n for n in dir(_cupy_flags.Flags) if not n.startswith("__")),
    "cupy.cuda.MemoryPointer": _names(_cupy.cuda.MemoryPointer),
    "cupy.cuda.MemoryPool": _names(_cupy.cuda.MemoryPool),
    "cupy": _names(_cupy),
    "cupy.cuda": _names(_cupy.cuda),
    "cupy.cuda.runtime": _names(_cupy.cuda.runtime),
    "cupy.cuda.Device": _names(_cupy.cuda.Device),
    "cupy.cuda.Stream": _names(_cupy.cuda.Stream),
    "cupy.cuda.Graph": _names(_cupy.cuda.Graph),
    "cupy.cuda.Event": _names(_cupy.cuda.Event),
    "cupy.RawModule": _names(_cupy.RawModule),
    "cupy.RawKernel": _names(_cupy.RawKernel),
}
CUPY_VERSION = _cupy.__version__
_THIS = os.path.abspath(__file__)
_BACKENDS_INIT = os.path.join(os.path.dirname(_THIS), "__init__.py")
_ARRAY_INTERFACE = os.path.join(os.path.dirname(os.path.dirname(_THIS)), "arrays.py")


class ContractError(AttributeError):
    """dspark touched an attribute, method or function that the installed CuPy does not have."""


def _missing(where: str, name: str):
    if name in SURFACE[where]:
        return NotImplementedError(f"{where}.{name} exists in CuPy {CUPY_VERSION} but the stand-in does not "
                                   "model it: add it to dspark/backends/contract.py")
    return ContractError(f"{where} has no attribute {name!r} in CuPy {CUPY_VERSION}: dspark must not use it")


class _Checked:
    """Attribute reads outside what the stand-in defines: NotImplementedError when CuPy has the
    name (the stand-in should model it), ContractError when CuPy does not."""
    _where = ""
    __slots__ = ()

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # Python's own protocol probes (copy, pickle, ...)
        raise _missing(self._where, name)


# ---- events -------------------------------------------------------------------------------------------
def _record(kind: str, amount: int = 1) -> None:
    if _CAPTURE[0] is not None and kind in _UNCAPTURABLE:
        _refuse_in_capture(_UNCAPTURABLE[kind])
    if profile.counting_now():
        site = profile.caller_site((_THIS, _BACKENDS_INIT, _ARRAY_INTERFACE)) if kind in ("d2h", "sync") else None
        profile.record(kind, site=site, amount=amount)


# ---- stream capture --------------------------------------------------------------------------------------
class CaptureError(RuntimeError):
    """What CUDA answers to an operation a capturing stream does not permit (CuPy raises its
    CUDARuntimeError, a RuntimeError): the capture is invalidated and its end_capture fails too."""


class _Capture:
    """The capture in progress: its stream, the work recorded so far (callables, in stream
    order), weak references to the buffers its kernels were given (a replay refuses freed ones),
    and why it was invalidated, if it was."""
    __slots__ = ("stream", "nodes", "buffers", "invalid", "kernels")

    def __init__(self, stream):
        self.stream, self.nodes, self.buffers, self.invalid, self.kernels = stream, [], [], None, []


_CAPTURE: list = [None]  # the capture in progress (CUDA's relaxed mode: one at a time here)
_UNCAPTURABLE = {"sync": "a synchronization", "d2h": "a device->host copy",
                 "h2d": "a host->device copy from pageable host memory"}


def _refuse_in_capture(what: str) -> None:
    cap = _CAPTURE[0]
    cap.invalid = cap.invalid or what
    raise CaptureError(f"cudaErrorStreamCaptureUnsupported: {what} while a stream is capturing (CUDA refuses it "
                       "and invalidates the capture)")


def _device_work(run, buffers=(), kernels=()) -> None:
    """Work on the device: done now, or recorded into the capture in progress (not done: captured
    work runs when the graph is launched, on whatever the buffers hold then). `kernels`: the names
    of the kernels it launches (a graph's launches are counted when it is launched)."""
    cap = _CAPTURE[0]
    if cap is None:
        run()
        return
    if _current_stream() is not cap.stream:
        _refuse_in_capture("work on another stream (the legacy default stream) than the capturing one")
    cap.nodes.append(run)
    cap.buffers.extend(weakref.ref(h) for h in buffers)
    cap.kernels.extend(kernels)


# ---- null memory and the stand-in's own time ---------------------------------------------------------------
_NULL = [False]


@contextlib.contextmanager
def null_memory():
    """Arrays made inside are untouched anonymous mappings (MAP_NORESERVE): shape, dtype and a
    device pointer of their own, and no memory until written. With execution off
    (`executing(False)`) nothing writes them, so Qwen3.5-27B's weights, caches and checkpoints fit
    on any machine: the null executor of profiling/host_round.py."""
    before = _NULL[0]
    _NULL[0] = True
    try:
        yield
    finally:
        _NULL[0] = before


def _null_array(shape, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(n) for n in shape)
    count = int(np.prod(shape, dtype=np.int64))
    m = mmap.mmap(-1, max(1, count * dt.itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    return np.frombuffer(m, dt, count).reshape(shape)


_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


class OwnTime:
    """The time the stand-in itself spends in CuPy's calls (its Python stands where CuPy's Cython
    and the driver would be), to be taken out of a host measurement: `ns` and `calls`."""
    __slots__ = ("ns", "calls", "depth")

    def __init__(self):
        self.ns = self.calls = self.depth = 0


_OWN: list = [None]


@contextlib.contextmanager
def own_time():
    """Account the stand-in's own time in CuPy's entry points while the block runs."""
    before, _OWN[0] = _OWN[0], OwnTime()
    try:
        yield _OWN[0]
    finally:
        _OWN[0] = before


def own_overhead(samples: int = 20000) -> float:
    """Seconds of the caller's time each accounted call adds outside its own interval (the
    timer's entry and exit), to be taken out with the stand-in's time."""
    idle = _own(lambda: None)
    base = time.thread_time_ns()
    for _ in range(samples):
        (lambda: None)()
    base = time.thread_time_ns() - base
    with own_time() as own:
        t = time.thread_time_ns()
        for _ in range(samples):
            idle()
        total = time.thread_time_ns() - t
    return max(0.0, (total - own.ns - base) / samples * 1e-9)


def _own(fn):
    """An entry point of CuPy's: its time (outermost call only) goes to the open OwnTime."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        acc = _OWN[0]
        if acc is None or acc.depth:
            return fn(*args, **kwargs)
        acc.depth = 1
        t = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            acc.ns += time.thread_time_ns() - t
            acc.calls += 1
            acc.depth = 0
    return timed


# ---- memory ----------------------------------------------------------------------------------------------
class MemoryPool(_Checked):
    """cupy.get_default_memory_pool(): live bytes of every device buffer the stand-in holds."""
    _where = "cupy.cuda.MemoryPool"
    __slots__ = ("_used", "_live", "__weakref__")

    def __init__(self):
        self._used = 0
        self._live: dict[int, weakref.ref] = {}

    def _track(self, h: np.ndarray) -> None:
        if (h.base is not None and not isinstance(h.base, mmap.mmap)) or h.nbytes == 0:
            return
        ref = self._live.get(id(h))
        if ref is not None and ref() is h:
            return
        if _CAPTURE[0] is not None:  # the pool would hand the graph memory it reuses once the array dies
            _refuse_in_capture("a memory-pool allocation")
        self._used += h.nbytes
        self._live[id(h)] = weakref.ref(h)
        weakref.finalize(h, self._release, id(h), h.nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self._used -= nbytes
        self._live.pop(key, None)

    def used_bytes(self) -> int:
        return self._used

    def total_bytes(self) -> int:
        return self._used

    def free_bytes(self) -> int:
        return 0

    def n_free_blocks(self) -> int:
        return 0

    def free_all_blocks(self, stream=None) -> None:
        pass

    def set_limit(self, size=None, fraction=None) -> None:
        pass

    def get_limit(self) -> int:
        return 0


_POOL = MemoryPool()


class MemoryPointer(_Checked):
    _where = "cupy.cuda.MemoryPointer"
    __slots__ = ("ptr", "device_id")

    def __init__(self, ptr: int):
        self.ptr = ptr
        self.device_id = 0


class Flags(_Checked):
    """ndarray.flags: only the flags CuPy's Flags class has."""
    _where = "cupy.ndarray.flags"
    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, h: np.ndarray):
        self.c_contiguous = bool(h.flags.c_contiguous)
        self.f_contiguous = bool(h.flags.f_contiguous)
        self.owndata = h.base is None

    @property
    def fnc(self) -> bool:
        return self.f_contiguous and not self.c_contiguous

    @property
    def forc(self) -> bool:
        return self.f_contiguous or self.c_contiguous


# ---- operands ----------------------------------------------------------------------------------------------
_SCALARS = (bool, int, float, complex, np.generic)


def _operand(x, what: str):
    """A device array's buffer, or a scalar; NumPy arrays and lists are refused, as CuPy's kernels
    refuse them (no implicit host->device copy)."""
    if isinstance(x, ndarray):
        return x._h
    if isinstance(x, _SCALARS):
        return x
    if _cai(x) is not None:
        return _from_cai(x)
    raise TypeError(f"{what}: Unsupported type {type(x)} (CuPy {CUPY_VERSION} does not convert host arrays "
                    "implicitly: use cupy.asarray)")


def _tree(x, what: str):
    if isinstance(x, (list, tuple)):
        return type(x)(_tree(v, what) for v in x)
    if isinstance(x, np.ndarray):
        raise TypeError(f"{what}: Unsupported type {type(x)} (CuPy {CUPY_VERSION} does not convert host arrays "
                        "implicitly: use cupy.asarray)")
    return x._h if isinstance(x, ndarray) else x


def _wrap(r):
    """NumPy results as device arrays; NumPy scalars become 0-d device arrays, as in CuPy."""
    if isinstance(r, np.ndarray):
        return ndarray._of(r)
    if isinstance(r, np.generic):
        return ndarray._of(np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(v) for v in r)
    if isinstance(r, list):
        return [_wrap(v) for v in r]
    return r


def _cai(x):
    try:
        return x.__cuda_array_interface__
    except AttributeError:
        return None


def _from_cai(x) -> np.ndarray:
    """A view of the memory a __cuda_array_interface__ describes (host memory in the stand-in)."""
    iface = _cai(x)
    shape, typestr = tuple(iface["shape"]), iface["typestr"]
    ptr, readonly = iface["data"]

    class _View:
        owner = x  # NumPy keeps this view object as the array's base: the foreign array stays alive
        __array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, readonly),
                               "strides": iface.get("strides"), "version": 3}
    return np.asarray(_View())


def _check_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype) if dtype is not None else np.dtype(np.float64)
    from ..dtypes import dtype_supported
    if dt.kind == "V" and not dtype_supported(_cupy, dt):
        raise ValueError(f"Unsupported dtype {dt}")
    return dt


# ---- ndarray ---------------------------------------------------------------------------------------------
_VIEWS = {"reshape", "view", "transpose", "swapaxes", "squeeze", "diagonal", "T", "mT", "real", "imag"}


class ndarray(_Checked):  # noqa: N801  (CuPy's name)
    """A device array: a host buffer behind exactly cupy.ndarray's surface."""
    _where = "cupy.ndarray"
    __slots__ = ("_h",)
    __array_priority__ = 100.0

    @_own
    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise NotImplementedError("the stand-in makes ndarray(shape, dtype) only")
        self._h = _new(shape, dtype, order)
        _POOL._track(self._h)

    @classmethod
    def _of(cls, h: np.ndarray) -> "ndarray":
        a = object.__new__(cls)
        a._h = h
        _POOL._track(h)
        return a

    # -- properties
    shape = property(lambda self: self._h.shape)
    ndim = property(lambda self: self._h.ndim)
    size = property(lambda self: self._h.size)
    dtype = property(lambda self: self._h.dtype)
    itemsize = property(lambda self: self._h.itemsize)
    nbytes = property(lambda self: self._h.nbytes)
    strides = property(lambda self: self._h.strides)
    flags = property(_own(lambda self: Flags(self._h)))
    data = property(_own(lambda self: MemoryPointer(int(self._h.__array_interface__["data"][0]))))
    T = property(lambda self: ndarray._of(self._h.T))
    mT = property(lambda self: ndarray._of(np.swapaxes(self._h, -1, -2)))
    real = property(lambda self: ndarray._of(self._h.real))
    imag = property(lambda self: ndarray._of(self._h.imag))
    base = property(lambda self: ndarray._of(self._h.base) if isinstance(self._h.base, np.ndarray) else None)
    device = property(lambda self: Device(0))

    @property
    @_own
    def __cuda_array_interface__(self) -> dict:
        h = self._h
        return {"shape": h.shape, "typestr": h.dtype.str, "descr": h.dtype.descr,
                "data": (int(h.__array_interface__["data"][0]), False),
                "strides": None if h.flags.c_contiguous else h.strides, "version": 3, "stream": 1}

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0

    # -- explicit copies to and from the host
    @_own
    def get(self, stream=None, order="C", out=None, blocking=True):
        _record("d2h")
        h = np.array(self._h, order=order)
        if out is not None:
            out[...] = h
            return out
        return h

    @_own
    def set(self, arr, stream=None):
        _record("h2d")
        self._h[...] = arr

    @_own
    def item(self):
        _record("d2h")
        return self._h.item()

    @_own
    def tolist(self):
        _record("d2h")
        return self._h.tolist()

    @_own
    def tobytes(self, order="C"):
        _record("d2h")
        return self._h.tobytes(order)

    def __int__(self):
        return int(self.get())

    def __float__(self):
        return float(self.get())

    def __complex__(self):
        return complex(self.get())

    def __bool__(self):
        return bool(self.get())

    def __repr__(self):
        return repr(self.get())

    def __str__(self):
        return str(self.get())

    def __format__(self, spec):
        return format(self.get(), spec)

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    # -- container
    def __len__(self):
        if not self._h.ndim:
            raise TypeError("len() of unsized object")
        return self._h.shape[0]

    def __iter__(self):
        if not self._h.ndim:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self._h.shape[0]))

    def _key(self, key):
        """(NumPy key, advanced?): device index arrays used in place; host index arrays and lists
        copied to the device first, as CuPy does."""
        parts = key if isinstance(key, tuple) else (key,)
        out, advanced = [], False
        for k in parts:
            if isinstance(k, ndarray):
                out.append(k._h)
                advanced = True
            elif isinstance(k, (np.ndarray, list)):
                _record("h2d")
                out.append(np.asarray(k))
                advanced = True
            else:
                out.append(k)
        if not advanced and not any(k is Ellipsis for k in out):
            out.append(Ellipsis)  # an integer index gives a 0-d view, as in CuPy, not a copy
        return tuple(out), advanced

    @_own
    def __getitem__(self, key):
        k, advanced = self._key(key)
        if advanced:
            _record("array_op")
        return ndarray._of(np.asarray(self._h[k]) if not advanced else self._h[k])

    @_own
    def __setitem__(self, key, value):
        k, advanced = self._key(key)
        _record("array_op")
        if isinstance(value, ndarray):
            v = value._h
        elif _cai(value) is not None:
            v = _from_cai(value)
        elif advanced:
            if isinstance(value, (np.ndarray, list)):
                _record("h2d")  # CuPy copies the values to the device for a scatter
            v = np.array(value)
        else:  # CuPy fills from a scalar only; a host array is refused
            v = np.asarray(value, dtype=self._h.dtype)
            if v.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        h = self._h

        def run():
            h[k] = v
        _device_work(run)

    # -- methods
    @_own
    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        dt = _check_dtype(dtype)
        if not copy and dt == self._h.dtype:
            return self
        _record("array_op")
        return ndarray._of(self._h.astype(dt, order=order, copy=True))

    @_own
    def copy(self, order="C"):
        _record("array_op")
        return ndarray._of(self._h.copy(order=order))

    @_own
    def fill(self, value):
        _record("array_op")
        self[...] = value

    @_own
    def view(self, dtype=None, array_class=None):
        return ndarray._of(self._h.view(_check_dtype(dtype)) if dtype is not None else self._h.view())

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    # -- NumPy interplay: CuPy's own rules
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        name = ufunc.__name__
        if name not in SURFACE["cupy"]:
            return NotImplemented
        for x in inputs:  # numpy.ndarray passes this test and is refused by the ufunc itself
            if not (type(x) in (bool, int, float, complex) or isinstance(x, (ndarray, np.ndarray, np.generic))
                    or _cai(x) is not None):
                return NotImplemented
        fn = getattr(cupy_module(), name)
        return fn(*inputs, **kwargs) if method == "__call__" else getattr(fn, method)(*inputs, **kwargs)

    def __array_function__(self, func, types_, args, kwargs):
        path = func.__module__.split(".")[1:]
        module = _cupy
        try:
            for p in path:
                module = getattr(module, p)
            getattr(module, func.__name__)
        except AttributeError:
            return NotImplemented
        if path:  # numpy.linalg & co: not modelled
            raise NotImplementedError(f"the stand-in does not model cupy.{'.'.join(path)}.{func.__name__}")
        if not all(issubclass(t, (ndarray, np.ndarray)) for t in types_):
            return NotImplemented
        return getattr(cupy_module(), func.__name__)(*args, **kwargs)


def _method(name):
    def m(self, *args, **kwargs):
        if name not in _VIEWS:
            _record("array_op")
        return _wrap(getattr(self._h, name)(*_tree(args, f"ndarray.{name}"), **_tree_kw(kwargs, name)))
    m.__name__ = name
    return m


def _tree_kw(kwargs, name):
    return {k: _tree(v, f"ndarray.{name}") for k, v in kwargs.items()}


def _binary(op, name):
    def m(self, other):
        _record("array_op")
        return _wrap(op(self._h, _operand(other, f"ndarray.{name}")))
    m.__name__ = name
    return m


def _reflected(op, name):
    def m(self, other):
        _record("array_op")
        return _wrap(op(_operand(other, f"ndarray.{name}"), self._h))
    m.__name__ = name
    return m


def _inplace(op, name):
    def m(self, other):
        _record("array_op")
        h, o = self._h, _operand(other, f"ndarray.{name}")
        _device_work(lambda: op(h, o))
        return self
    m.__name__ = name
    return m


def _unary(op, name):
    def m(self):
        _record("array_op")
        return _wrap(op(self._h))
    m.__name__ = name
    return m


_BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
           "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow, "matmul": operator.matmul,
           "and": operator.and_, "or": operator.or_, "xor": operator.xor, "lshift": operator.lshift,
           "rshift": operator.rshift, "divmod": divmod}
_INPLACE = {"add": operator.iadd, "sub": operator.isub, "mul": operator.imul, "truediv": operator.itruediv,
            "floordiv": operator.ifloordiv, "mod": operator.imod, "pow": operator.ipow, "and": operator.iand,
            "or": operator.ior, "xor": operator.ixor, "lshift": operator.ilshift, "rshift": operator.irshift}
_COMPARE = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
            "ge": operator.ge}
_UNARY = {"neg": operator.neg, "pos": operator.pos, "abs": operator.abs, "invert": operator.invert}


def _build_ndarray():
    surface = SURFACE["cupy.ndarray"]
    for n, op in _BINARY.items():
        for dunder, make in ((f"__{n}__", _binary), (f"__r{n}__", _reflected)):
            if dunder in surface:
                setattr(ndarray, dunder, _own(make(op, dunder)))
    for n, op in _INPLACE.items():
        if f"__i{n}__" in surface:
            setattr(ndarray, f"__i{n}__", _own(_inplace(op, f"__i{n}__")))
    for n, op in _COMPARE.items():
        setattr(ndarray, f"__{n}__", _own(_binary(op, f"__{n}__")))
    ndarray.__hash__ = None
    for n, op in _UNARY.items():
        if f"__{n}__" in surface:
            setattr(ndarray, f"__{n}__", _own(_unary(op, f"__{n}__")))
    for n in sorted(surface):  # every other method CuPy and NumPy share, with NumPy's semantics
        if n.startswith("_") or n in ndarray.__dict__ or not callable(getattr(np.ndarray, n, None)):
            continue
        setattr(ndarray, n, _own(_method(n)))


_build_ndarray()


def surface_excess() -> list[str]:
    """Names the stand-in's ndarray defines that cupy.ndarray lacks (must be empty): private
    `_x` names and Python's class machinery aside."""
    machinery = {"__dict__", "__weakref__", "__slots__", "__module__", "__qualname__", "__annotations__",
                 "__getattr__", "__static_attributes__", "__firstlineno__"}
    return sorted(n for n in dir(ndarray) if n not in SURFACE["cupy.ndarray"] and n not in machinery
                  and not (n.startswith("_") and not n.startswith("__")))


# ---- kernels ---------------------------------------------------------------------------------------------
_EXECUTING = [True]


@contextlib.contextmanager
def executing(on: bool):
    """Launches inside run their kernels (on simt) or, with on=False, stop after the host path:
    arguments checked and packed as CuPy would, nothing executed, outputs left as they were. What
    the host pays per launch is timed so (profiling/launch_cost.py)."""
    before = _EXECUTING[0]
    _EXECUTING[0] = bool(on)
    try:
        yield
    finally:
        _EXECUTING[0] = before


class RawKernel(_Checked):
    """One entry point of a loaded cubin, executed by simt on the stand-in's buffers."""
    _where = "cupy.RawKernel"
    __slots__ = ("name", "file_path", "max_dynamic_shared_size_bytes")

    MAX_THREADS_PER_BLOCK = 1024
    STATIC_SMEM_LIMIT = 48 * 1024

    def __init__(self, name: str, path: str):
        self.name, self.file_path = name, path
        self.max_dynamic_shared_size_bytes = 0

    @_own
    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        if not isinstance(grid, tuple) or not isinstance(block, tuple):
            raise TypeError(f"{self.name}: grid and block must be tuples, got {type(grid)} and {type(block)}")
        if not isinstance(args, tuple):
            raise TypeError(f"{self.name}: args must be a tuple, got {type(args)}")
        g = tuple(int(v) for v in grid) + (1,) * (3 - len(grid))
        b = tuple(int(v) for v in block) + (1,) * (3 - len(block))
        if b[0] * b[1] * b[2] > self.MAX_THREADS_PER_BLOCK:
            raise RuntimeError(f"{self.name}: CUDA_ERROR_INVALID_VALUE (block {b})")
        if shared_mem > self.STATIC_SMEM_LIMIT and shared_mem > self.max_dynamic_shared_size_bytes:
            raise RuntimeError(f"{self.name}: CUDA_ERROR_INVALID_VALUE: {shared_mem} bytes of dynamic shared memory "
                               f"need max_dynamic_shared_size_bytes >= it (is {self.max_dynamic_shared_size_bytes})")
        slots = []
        for i, a in enumerate(args):
            if isinstance(a, ndarray):
                slots.append(struct.pack("<Q", a.data.ptr))
            elif _cai(a) is not None:
                slots.append(struct.pack("<Q", int(_cai(a)["data"][0])))
            elif isinstance(a, np.generic):
                slots.append(a.tobytes().ljust(8, b"\0"))
            elif isinstance(a, (bool, int, float)):  # CuPy passes these as int64 / float64 / bool
                slots.append(np.asarray(a).tobytes().ljust(8, b"\0"))
            else:
                raise TypeError(f"{self.name}: argument {i}: Unsupported type {type(a)}")
        if not all(g):
            return  # an empty grid launches nothing
        run = functools.partial(_execute, self.name, g, b, b"".join(slots), int(shared_mem))
        # A capture keeps the argument bytes as they are now: a host value baked in replays stale.
        _device_work(run, [_root(a._h) for a in args if isinstance(a, ndarray)], (self.name,))


def _root(h: np.ndarray) -> np.ndarray:
    """The allocation a view belongs to (what a captured graph must find alive)."""
    while isinstance(h.base, np.ndarray):
        h = h.base
    return h


def _execute(name: str, grid, block, payload: bytes, shared_mem: int) -> None:
    """Run one launch on simt, unless execution is off (then only the host path ran)."""
    if _EXECUTING[0]:
        from .simt import load_module  # only to execute: loading cubins needs no simt build
        load_module().launch(name, grid, block, payload, shared_mem)


class RawModule(_Checked):
    """cupy.RawModule(path=...): a cubin dspark compiled; its kernels run on simt."""
    _where = "cupy.RawModule"
    __slots__ = ("file_path", "code", "options", "backend", "_bytes", "_owner")

    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=None):
        if code is not None or path is None:
            raise NotImplementedError("the stand-in loads compiled modules only: RawModule(path=...)")
        if not isinstance(options, tuple):
            raise TypeError(f"options must be a tuple, got {type(options)}")
        with open(path, "rb") as f:
            data = f.read()
        if data[:4] != b"\x7fELF":
            raise RuntimeError(f"{path}: CUDA_ERROR_INVALID_IMAGE (not a cubin)")
        self.file_path, self.code, self.options, self.backend = path, None, options, backend
        self._bytes = data
        self._owner = _OWNER[0]
        self._owner.loaded[path] = data

    @_own
    def get_function(self, name: str) -> RawKernel:
        if name.encode() + b"\0" not in self._bytes:
            raise RuntimeError(f"{name}: CUDA_ERROR_NOT_FOUND in {self.file_path}")
        return RawKernel(name, self.file_path)


# ---- devices and streams -------------------------------------------------------------------------------
class Device(_Checked):
    _where = "cupy.cuda.Device"
    __slots__ = ("id",)
    ARCH = ["90"]

    def __init__(self, device=None):
        self.id = int(device or 0)

    @property
    def compute_capability(self) -> str:
        return self.ARCH[0]

    @_own
    def synchronize(self) -> None:
        _record("sync")

    def use(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    @property
    def mem_info(self) -> tuple[int, int]:
        return (1 << 36, 1 << 37)


class Stream(_Checked):
    """A stream: `with stream:` makes it current (launches and device work go to the current
    stream), `use()` makes it current until another is used. Capture as CUDA's relaxed mode
    allows it (begin_capture / end_capture on a stream that is not the legacy default stream):
    see the module doc."""
    _where = "cupy.cuda.Stream"
    __slots__ = ("ptr",)

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.ptr = 0 if null else next(_STREAM_HANDLES)

    @_own
    def synchronize(self) -> None:
        _record("sync")

    def use(self):
        _USED[0] = self
        return self

    def __enter__(self):
        _ENTERED.append(self)
        return self

    def __exit__(self, *exc):
        _ENTERED.pop()
        return None

    @_own
    def begin_capture(self, mode=None) -> None:
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if _CAPTURE[0] is not None:
            raise CaptureError("cudaErrorIllegalState: a capture is already in progress")
        _CAPTURE[0] = _Capture(self)

    @_own
    def end_capture(self) -> "Graph":
        cap = _CAPTURE[0]
        if cap is None or cap.stream is not self:
            raise CaptureError("cudaErrorIllegalState: this stream is not capturing")
        _CAPTURE[0] = None
        if cap.invalid:
            raise CaptureError(f"cudaErrorStreamCaptureInvalidated: the capture was invalidated by {cap.invalid}")
        return Graph(cap.nodes, cap.buffers, cap.kernels)

    def is_capturing(self) -> bool:
        return _CAPTURE[0] is not None and _CAPTURE[0].stream is self

    def record(self, event=None) -> "Event":
        """An event after the work issued so far (everything here has run: it is complete)."""
        return event if event is not None else Event()

    def wait_event(self, event) -> None:
        """Later work waits for the event (work here runs in issue order: nothing to wait for)."""
        if not isinstance(event, Event):
            raise TypeError(f"wait_event: expected a cupy.cuda.Event, got {type(event)}")


class Event(_Checked):
    _where = "cupy.cuda.Event"
    __slots__ = ("ptr", "at")

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.ptr = next(_STREAM_HANDLES)
        self.at = None  # host time of the record: work here runs as it is issued

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    @_own
    def synchronize(self) -> None:
        _record("sync")

    @property
    def done(self) -> bool:
        return True


Stream.null = Stream(null=True)
_STREAM_HANDLES = iter(range(0x1000, 1 << 62, 0x10))
_ENTERED: list = []     # streams entered by `with`, innermost last
_USED: list = [None]    # the stream of the last use()


def _current_stream() -> Stream:
    return _ENTERED[-1] if _ENTERED else (_USED[0] or Stream.null)


class Graph(_Checked):
    """cupy.cuda.Graph: the work a capture recorded. launch() runs it, in order, on what the
    buffers hold at launch time with the arguments they had at capture time. A buffer a captured
    kernel was given that has been freed since makes launch() raise (CUDA would read or write
    memory the pool has handed out again)."""
    _where = "cupy.cuda.Graph"
    __slots__ = ("graph", "graphExec", "_nodes", "_buffers", "_kernels")

    def __init__(self, nodes, buffers, kernels):
        self.graph = self.graphExec = id(self)
        self._nodes, self._buffers, self._kernels = tuple(nodes), tuple(buffers), tuple(kernels)

    @_own
    def launch(self, stream=None) -> None:
        _record("graph", len(self._kernels))
        if profile.counting_now():
            for name in self._kernels:
                profile.record("launch", name)
        _device_work(self._run, kernels=self._kernels)  # into a capture in progress: a child graph

    def _run(self) -> None:
        if not _EXECUTING[0]:
            return
        if any(ref() is None for ref in self._buffers):
            raise RuntimeError("cudaGraphLaunch: a buffer the graph was captured with has been freed since")
        for node in self._nodes:
            node()

    def upload(self, stream=None) -> None:
        pass


def graph_nodes(graph: Graph) -> int:
    """The work items a stand-in graph holds (kernel launches and in-place array operations)."""
    return len(graph._nodes)


class _Namespace(types.SimpleNamespace):
    """A module of the stand-in: names it defines, else ContractError / NotImplementedError."""

    def __init__(self, where: str, **names):
        super().__init__(**names)
        object.__setattr__(self, "_where", where)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise _missing(self._where, name)


@_own
def _device_synchronize() -> None:
    _record("sync")


def _mem_get_info() -> tuple[int, int]:
    """(free, total) device bytes: the stand-in's device is the host's memory."""
    from . import host_available
    return host_available(), os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events (CuPy refuses an unrecorded one too)."""
    if start.at is None or end.at is None:
        raise RuntimeError("get_elapsed_time: both events must be recorded")
    return (end.at - start.at) * 1e3


_RUNTIME = _Namespace("cupy.cuda.runtime", getDeviceCount=lambda: 1, deviceSynchronize=_device_synchronize,
                      memGetInfo=_mem_get_info)
_CUDA = _Namespace("cupy.cuda", Device=Device, Stream=Stream, Graph=Graph, Event=Event, MemoryPool=MemoryPool,
                   MemoryPointer=MemoryPointer, runtime=_RUNTIME, get_current_stream=lambda device=None: _current_stream(),
                   is_available=lambda: True, get_elapsed_time=_get_elapsed_time)


# ---- the cupy module ---------------------------------------------------------------------------------
@_own
def _asarray(a, dtype=None, order=None, *, blocking=False):
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    if _cai(a) is not None:
        h = _from_cai(a)
        return ndarray._of(h) if dtype is None or np.dtype(dtype) == h.dtype else ndarray._of(h).astype(dtype)
    _record("h2d")
    h = np.array(a, dtype=dtype, order=order or "K")
    _check_dtype(h.dtype)
    return ndarray._of(h)


@_own
def _array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray) or _cai(obj) is not None:
        a = _asarray(obj, dtype)
        return a.copy() if copy else a
    _record("h2d")
    h = np.array(obj, dtype=dtype, order=order, ndmin=ndmin)
    _check_dtype(h.dtype)
    return ndarray._of(h)


@_own
def _ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy._core.core._ndarray_base, got {type(a)})")
    if a._h.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    _record("array_op")
    return ndarray._of(np.ascontiguousarray(a._h, dtype=dtype))


@_own
def _asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


@_own
def _empty(shape, dtype=float, order="C"):
    return ndarray._of(_new(shape, dtype, order))


def _new(shape, dtype, order="C") -> np.ndarray:
    """Fresh device memory: NumPy's, or an untouched mapping under null_memory()."""
    return _null_array(shape, _check_dtype(dtype)) if _NULL[0] else np.empty(shape, _check_dtype(dtype), order=order)


def _filled(name, value):
    @_own
    def f(shape, dtype=float, order="C"):
        _record("array_op")  # a memset or a fill kernel
        if _NULL[0] and value == 0:
            return ndarray._of(_new(shape, dtype))  # an untouched mapping reads as zeros
        return ndarray._of(np.full(shape, value, _check_dtype(dtype), order=order))
    f.__name__ = name
    return f


@_own
def _full(shape, fill_value, dtype=None, order="C"):
    _record("array_op")
    h = np.full(shape, _operand(fill_value, "cupy.full"), dtype=dtype, order=order)
    _check_dtype(h.dtype)
    return ndarray._of(h)


def _like(name):
    npf = getattr(np, name)

    @_own
    def f(a, dtype=None, *args, **kwargs):
        if not isinstance(a, ndarray):
            raise TypeError(f"cupy.{name}: Unsupported type {type(a)}")
        if name != "empty_like":
            _record("array_op")
        if _NULL[0] and name in ("empty_like", "zeros_like") and not args and not kwargs:
            return ndarray._of(_new(a.shape, a.dtype if dtype is None else dtype))
        return ndarray._of(npf(a._h, dtype, *_tree(args, name), **kwargs))
    f.__name__ = name
    return f


def _function(name):
    npf = getattr(np, name)

    @_own
    def f(*args, **kwargs):
        if name not in _VIEWS:
            _record("array_op")
        a, k = _tree(args, f"cupy.{name}"), {key: _tree(v, f"cupy.{name}") for key, v in kwargs.items()}
        if name in _IN_PLACE or isinstance(kwargs.get("out"), ndarray):  # writes existing memory: capturable
            _device_work(lambda: npf(*a, **k))
            return kwargs.get("out")
        return _wrap(npf(*a, **k))
    f.__name__ = name
    return f


_IN_PLACE = {"copyto", "put", "place", "putmask"}  # cupy functions that write an existing array


class _Ufunc:
    """A cupy ufunc: device arrays and scalars only."""

    def __init__(self, name):
        self.__name__ = name
        self._np = getattr(np, name)

    @_own
    def __call__(self, *args, out=None, **kwargs):
        _record("array_op")
        ins = [_operand(a, f"cupy.{self.__name__}") for a in args]
        if out is not None:
            if not isinstance(out, ndarray):
                raise TypeError(f"cupy.{self.__name__}: out must be a cupy.ndarray, got {type(out)}")
            h = out._h
            _device_work(lambda: self._np(*ins, out=h, **kwargs))
            return out
        return _wrap(self._np(*ins, **kwargs))

    @_own
    def reduce(self, a, *args, **kwargs):
        _record("array_op")
        return _wrap(self._np.reduce(_operand(a, f"cupy.{self.__name__}.reduce"), *args, **kwargs))

    @_own
    def accumulate(self, a, *args, **kwargs):
        _record("array_op")
        return _wrap(self._np.accumulate(_operand(a, f"cupy.{self.__name__}.accumulate"), *args, **kwargs))


@_own
def _get_array_module(*args):
    return cupy_module() if any(isinstance(a, ndarray) for a in args) else np


@_own
def _from_dlpack(x, *, device=None, copy=None):
    """cupy.from_dlpack: DLPack only (CuPy does not fall back on __cuda_array_interface__); the
    capsule is read by dspark.arrays.dlpack_view, as the stand-in's device memory is host memory.
    bfloat16 comes through where the installed CuPy holds it."""
    if isinstance(x, ndarray):
        return x
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"from_dlpack: {type(x)} does not implement __dlpack__")
    if int(x.__dlpack_device__()[0]) not in (2, 13):
        raise BufferError(f"from_dlpack: {type(x)} is not in device memory")
    from ..arrays import dlpack_view
    h = dlpack_view(x)
    _check_dtype(h.dtype)
    return ndarray._of(h)


_EXPLICIT = {
    "ndarray": ndarray, "asarray": _asarray, "array": _array, "ascontiguousarray": _ascontiguousarray,
    "asnumpy": _asnumpy, "get_array_module": _get_array_module, "from_dlpack": _from_dlpack,
    "get_default_memory_pool": lambda: _POOL, "RawModule": RawModule, "RawKernel": RawKernel, "cuda": _CUDA,
    "empty_like": _like("empty_like"), "zeros_like": _like("zeros_like"), "ones_like": _like("ones_like"),
    "full_like": _like("full_like"), "empty": _empty, "zeros": _filled("zeros", 0), "ones": _filled("ones", 1),
    "full": _full,
}


class _CupyModule(types.ModuleType):
    """The `cupy` module of the stand-in: each name the installed cupy has, modelled on NumPy's
    function of that name (device arrays in, device arrays out, host arrays refused); a name
    cupy lacks raises ContractError."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in SURFACE["cupy"]:
            raise _missing("cupy", name)
        real = getattr(_cupy, name)
        if name in _EXPLICIT:
            value = _EXPLICIT[name]
        elif getattr(np, name, None) is real or isinstance(real, float) or real is None:
            value = real  # dtypes, newaxis and constants: NumPy's own objects in CuPy too
        elif type(real).__name__ == "ufunc" and isinstance(getattr(np, name, None), np.ufunc):
            value = _Ufunc(name)
        elif callable(real) and callable(getattr(np, name, None)):
            value = _function(name)
        else:
            raise _missing("cupy", name)  # CuPy has it: NotImplementedError, the stand-in should model it
        setattr(self, name, value)
        return value


_OWNER: list = []


@functools.lru_cache(maxsize=None)
def cupy_module() -> _CupyModule:
    m = _CupyModule("cupy")
    m.__version__ = CUPY_VERSION
    m.loaded = {}  # cubin path -> the bytes RawModule loaded
    _OWNER.append(m)
    from . import register_array_module
    register_array_module(ndarray, m)
    return m


def backend(arch: str = "sm_90", nvrtc=None):
    """dspark's `cuda` Backend on the stand-in, for device `arch` (the cubins are built for it,
    by `nvrtc`, a dspark.toolchain.Nvrtc: default the toolchain's choice)."""
    from . import Backend
    from .cuda import CudaExecutor
    xp = cupy_module()
    Device.ARCH[0] = arch.removeprefix("sm_")
    return Backend("cuda", xp, CudaExecutor(cupy=xp, arch=arch, nvrtc=nvrtc))


def pool() -> MemoryPool:
    return _POOL
