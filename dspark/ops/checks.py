"""Validation shared by the ops: clear errors that name the argument and the expectation."""

from __future__ import annotations

import numpy as np

from ..arrays import as_array, readonly
from ..errors import DTypeError, KernelArgumentError, ShapeError


def require_ndim(a, ndim: int, what: str, layout: str) -> None:
    if getattr(a, "ndim", None) != ndim:
        shape = getattr(a, "shape", type(a).__name__)
        raise ShapeError(f"{what} has shape {shape}: expected {ndim} dims {layout}")


def require_dtype(a, dtype, what: str) -> None:
    if a.dtype != np.dtype(dtype):
        raise DTypeError(f"{what} has dtype {a.dtype}: expected {np.dtype(dtype)}")


def require_shape(a, shape: tuple, what: str) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ShapeError(f"{what} has shape {tuple(a.shape)}: expected {tuple(shape)}")


def require_weights_for(w, k: int, rows: int, out, source: str) -> int:
    """N of a product's weights w [K, N] (any matrix `linear` takes) for K input columns, after the
    checks of w and of out (None, or f32 [rows, N]); `source` names the input in the message."""
    if getattr(w, "ndim", 0) != 2 or w.shape[0] != k:
        raise ShapeError(f"w has shape {tuple(getattr(w, 'shape', ()))}: expected ({k}, N) for {source}")
    n = w.shape[1]
    if out is not None:
        require_shape(out, (rows, n), "out")
        require_dtype(out, np.float32, "out")
    return n


def output(be, out, shape: tuple, dtype, what: str = "out"):
    """`out` checked for `shape` and `dtype`, or a fresh array of them when None."""
    out = be.xp.empty(shape, dtype) if out is None else out
    require_shape(out, shape, what)
    require_dtype(out, dtype, what)
    return out


def require_indptr(indptr: np.ndarray, what: str, total: int) -> None:
    """A CSR row pointer: int32, starts at 0, non-decreasing, ends at `total`."""
    require_ndim(indptr, 1, what, "[B+1]")
    require_dtype(indptr, np.int32, what)
    if indptr.shape[0] < 1 or int(indptr[0]) != 0 or int(indptr[-1]) != total:
        raise ShapeError(f"{what} must start at 0 and end at {total}, got {np.asarray(indptr).tolist()[:8]}...")
    if np.any(np.diff(indptr) < 0):
        raise ShapeError(f"{what} must be non-decreasing")


def require_dense(be, a, what: str, *, writable: bool = False, align: int = 16) -> None:
    """An array a kernel reaches through a pointer table (so the launcher never sees it): it must
    be C-contiguous (kernels address it by its shape), start `align`-byte aligned (kernels that
    move 16-byte words need 16) and not be read-only (by its array interface) when the kernel
    writes it."""
    if not a.flags.c_contiguous:
        raise KernelArgumentError(f"{what} is not C-contiguous: the kernel addresses it by its shape")
    if be.address(a) % align:
        raise KernelArgumentError(f"{what} starts at an address that is not {align}-byte aligned")
    if writable and readonly(a):
        raise KernelArgumentError(f"{what} is read-only: the kernel writes it")


class Staged:
    """A small host index array (a row pointer) and its copy on the backend, uploaded once for the
    several ops of one pass that read it (or views of a pass's inputs block: Staged.of)."""
    __slots__ = ("host", "device")

    def __init__(self, be, host, device=None):
        self.host = np.asarray(host)
        self.device = be.asarray(self.host) if device is None else device  # `device`: already uploaded

    @classmethod
    def of(cls, host, device) -> "Staged":
        """Host and device views of memory that is uploaded elsewhere (dspark.ops.workspace.Inputs)."""
        s = object.__new__(cls)
        s.host, s.device = host, device
        return s

    def __array__(self, dtype=None, copy=None):  # numpy.asarray(staged): the host values
        return self.host if dtype is None else self.host.astype(dtype)


def host_and_device(be, a, what: str = "an index array") -> tuple[np.ndarray, object]:
    """(host copy, backend array) of a small index array the op validates on the host and a kernel
    reads: a Staged array costs nothing, a host array one upload and no wait on the device, a
    device array one device->host copy (a sync on a GPU). The round's hot path passes host or
    Staged arrays; a foreign array (DLPack, an array interface) is adopted without a copy first."""
    if isinstance(a, Staged):
        return a.host, a.device
    a = as_array(be, a, what)
    if be.xp is np or not isinstance(a, be.xp.ndarray):
        host = np.asarray(a)
        return host, be.asarray(host)
    return be.to_host(a), a
