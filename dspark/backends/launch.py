"""The launch convention shared by the simt and cuda executors.

`fn(grid, block, args, shared_mem=0)` as in CuPy's RawKernel. Before either executor runs a
kernel, every argument is checked against the C++ parameter parsed from the source: a pointer
needs a C-contiguous array whose element size matches (and whose array interface does not mark it
read-only when the pointee is not const: CuPy arrays have no `writeable` flag); a scalar needs exactly the NumPy scalar type, because a Python int where an int32
is expected would be passed with the wrong width on a GPU.
"""

from __future__ import annotations

import numpy as np

from ..arrays import readonly
from ..errors import KernelArgumentError
from ..kernel_sources import Param, Signature

MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_THREADS = 1024
MAX_SHARED_MEM = 227 * 1024  # sm_90 opt-in limit per block


def dims3(value, what: str, kernel: str, limits) -> tuple[int, int, int]:
    t = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(t) <= 3 or not all(isinstance(v, (int, np.integer)) for v in t):
        raise KernelArgumentError(f"{kernel}: {what}={value!r}: expected an int or a tuple of 1-3 ints")
    t = tuple(int(v) for v in t) + (1,) * (3 - len(t))
    for axis, v, lim in zip("xyz", t, limits):
        lo = 0 if what == "grid" else 1
        if not lo <= v <= lim:
            raise KernelArgumentError(f"{kernel}: {what}.{axis}={v} is outside [{lo}, {lim}]")
    return t


def check_launch(sig: Signature, grid, block, args, shared_mem) -> tuple:
    g = dims3(grid, "grid", sig.name, MAX_GRID)
    b = dims3(block, "block", sig.name, MAX_BLOCK)
    if b[0] * b[1] * b[2] > MAX_THREADS:
        raise KernelArgumentError(f"{sig.name}: block {b} has {b[0] * b[1] * b[2]} threads, more than {MAX_THREADS}")
    if not isinstance(shared_mem, (int, np.integer)) or not 0 <= shared_mem <= MAX_SHARED_MEM:
        raise KernelArgumentError(f"{sig.name}: shared_mem={shared_mem!r}: expected an int in [0, {MAX_SHARED_MEM}]")
    if not isinstance(args, (tuple, list)) or len(args) != len(sig.params):
        n = len(args) if isinstance(args, (tuple, list)) else type(args).__name__
        raise KernelArgumentError(f"{sig.name}: expected a tuple of {len(sig.params)} arguments, got {n}")
    return g, b, int(shared_mem)


def check_pointer(sig: Signature, p: Param, arg, array_type) -> None:
    where = f"{sig.name}: parameter '{p.name}' ({p.ctype})"
    if not isinstance(arg, array_type):
        raise KernelArgumentError(f"{where} needs a {array_type.__module__}.{array_type.__name__}, "
                                  f"got {type(arg).__name__}")
    if p.elem and arg.dtype.itemsize != p.elem:
        raise KernelArgumentError(f"{where} needs {p.elem}-byte elements, got {arg.dtype} ({arg.dtype.itemsize} bytes)")
    if not arg.flags.c_contiguous:
        raise KernelArgumentError(f"{where} needs a C-contiguous array")
    if not p.is_const and readonly(arg):
        raise KernelArgumentError(f"{where} is written by the kernel but the array is read-only")


def check_scalar(sig: Signature, p: Param, arg) -> None:
    want = np.dtype(p.code).type
    if type(arg) is not want:
        raise KernelArgumentError(f"{sig.name}: parameter '{p.name}' ({p.ctype}) needs numpy.{want.__name__}, "
                                  f"got {type(arg).__name__} {arg!r}")


def check_args(sig: Signature, args, array_type) -> None:
    """Check each argument; pointers may also be None (a null pointer, for optional outputs)."""
    for p, a in zip(sig.params, args):
        if p.code == "ptr":
            if a is not None:
                check_pointer(sig, p, a, array_type)
        else:
            check_scalar(sig, p, a)
