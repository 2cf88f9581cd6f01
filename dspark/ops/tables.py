"""Pointer tables: the element addresses of a list of arrays, for a kernel's `T* const*` parameter.

An op that reaches per-session buffers (caches, recurrent states) through a table takes either a
list of arrays, validated and uploaded on every call, or a `PointerTable`: the same list validated
(dtype, shape, C-contiguous, alignment, writable) and uploaded once, whose later uses cost a few
tuple comparisons and no copy. The trunk and drafter keep one set of tables per batch of caches
(dspark.models.batch_tables); a table holds its arrays, so its addresses stay valid while it lives.
"""

from __future__ import annotations

import numpy as np

from ..arrays import readonly
from ..errors import DTypeError, KernelArgumentError, ShapeError
from .checks import require_dtype, require_shape

MAX_ALIGN = 256


class PointerTable:
    """`arrays` validated once; `device` the uint64 table of their addresses on the backend."""
    __slots__ = ("arrays", "device", "shapes", "dtype", "writable", "aligns", "what")

    def __init__(self, be, arrays, what: str, *, writable: bool = False):
        if not isinstance(arrays, (list, tuple)):
            raise ShapeError(f"{what} is a {type(arrays).__name__}: expected a list of arrays")
        dtypes, aligns = set(), []
        for i, a in enumerate(arrays):
            name = f"{what}[{i}]"
            if not isinstance(a, be.xp.ndarray):
                raise DTypeError(f"{name} is a {type(a).__name__}: expected a {be.xp.__name__}.ndarray")
            if not a.flags.c_contiguous:
                raise KernelArgumentError(f"{name} is not C-contiguous: the kernel addresses it by its shape")
            if writable and readonly(a):
                raise KernelArgumentError(f"{name} is read-only: the kernel writes it")
            address = be.address(a)
            aligns.append(min(MAX_ALIGN, address & -address) if address else MAX_ALIGN)
            dtypes.add(np.dtype(a.dtype))
        self.arrays = tuple(arrays)
        self.shapes = tuple(tuple(a.shape) for a in arrays)
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None  # None: mixed (or empty)
        self.writable, self.aligns, self.what = writable, tuple(aligns), what
        self.device = be.pointer_table(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)

    def require(self, what: str, *, count: int | None = None, shape: tuple | None = None, dtype=None,
                writable: bool = False, align: int = 4) -> None:
        """The checks an op makes of a list, on the validated facts: count, every shape (None in
        `shape` matches any extent), dtype, writability and alignment."""
        if count is not None and len(self.arrays) != count:
            raise ShapeError(f"{what} has {len(self.arrays)} arrays: expected {count}, one per session")
        if shape is not None:
            for i, s in enumerate(self.shapes):
                if len(s) != len(shape) or any(w is not None and w != g for w, g in zip(shape, s)):
                    want = tuple("any" if w is None else w for w in shape)
                    raise ShapeError(f"{what}[{i}] has shape {s}: expected {want}")
        if dtype is not None and self.arrays:
            for i, a in enumerate(self.arrays):
                require_dtype(a, dtype, f"{what}[{i}]")
        if writable and not self.writable:
            raise KernelArgumentError(f"{what}: the kernel writes it, but its table was validated read-only")
        for i, a in enumerate(self.aligns):
            if a < align:
                raise KernelArgumentError(f"{what}[{i}] starts at an address that is not {align}-byte aligned")


def as_table(be, arrays, what: str, *, count: int | None = None, shape: tuple | None = None, dtype=None,
             writable: bool = False, align: int = 4) -> PointerTable:
    """`arrays` (a list, or a PointerTable made earlier) as a validated PointerTable. A list is
    checked entry by entry with messages naming the entry, then uploaded."""
    if isinstance(arrays, PointerTable):
        arrays.require(what, count=count, shape=shape, dtype=dtype, writable=writable, align=align)
        return arrays
    if not isinstance(arrays, (list, tuple)):
        raise ShapeError(f"{what} is a {type(arrays).__name__}: expected a list of arrays")
    if count is not None and len(arrays) != count:
        raise ShapeError(f"{what} has {len(arrays)} arrays: expected {count}, one per session")
    for i, a in enumerate(arrays):
        name = f"{what}[{i}]"
        if not isinstance(a, be.xp.ndarray):
            raise DTypeError(f"{name} is a {type(a).__name__}: expected a {be.xp.__name__}.ndarray")
        if dtype is not None:
            require_dtype(a, dtype, name)
        if shape is not None and None not in shape:
            require_shape(a, shape, name)
    table = PointerTable(be, arrays, what, writable=writable)
    table.require(what, shape=shape, align=align)
    return table
