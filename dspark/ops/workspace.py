"""A pass's buffers by name, made once: what lets a recorded or captured pass run again.

A pass (the drafter's, a verify, a commit, a decode step) asks for every output and temporary by
name: `ws.take("mlp.gate_up", rows, (2 * F,))`. The first request allocates the backing array,
sized for the workspace's `rows_max` rows; every later request of that name gets the same memory
(a view of its first `rows` rows). So launches recorded once, or captured into a CUDA graph, find
their buffers where they left them, and passes of several widths share one set of buffers: the
verify programs of every width of a batch read and write the same [rows_max, ...] arrays, views of
their first B * width rows.

Names reused within a pass must not overlap in time (kernels run in stream order, so a layer may
reuse the buffers of the layer before). A name asked for with another trailing shape or dtype is a
bug and raises. `fixed` gives arrays of an exact shape (tickets, per-session values); `zero` ones
are zeroed once when made (the row-split tickets are zero at rest: every kernel puts back what it
used). `bytes` is what the workspace holds; `fills` counts the zero-fills it made (device work that
happens once, outside any recording).

Without a workspace (ws=None) an op allocates its outputs and scratch per call, as a plain pass may.

`Inputs` is the other half: a pass's small per-round arrays (token ids, positions, row pointers,
kept counts, capacities) in one host buffer and one device buffer. The host fills the fields, one
copy uploads them all, and kernels read the device views (ops take them as Staged: the host view
is what they validate). A recorded pass reads its round's values there, never a host scalar baked
into its arguments.
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from .checks import Staged


class Workspace:
    """`owner`: the allocator owner its buffers are counted under (a program's workspace, freed with
    it); None: a pass's own temporaries, released with the last reference to them."""

    def __init__(self, be, rows_max: int, owner: str | None = None):
        self.be, self.rows_max, self.owner = be, int(rows_max), owner
        self._backing: dict[str, object] = {}
        self.fills = 0

    def take(self, name: str, rows: int, tail: tuple = (), dtype=np.float32, zero: bool = False):
        """Rows [0, rows) of the buffer `name` [rows_max, *tail]."""
        if not 0 <= rows <= self.rows_max:
            raise ShapeError(f"workspace {self.owner!r}: {name} asks for {rows} rows, it holds {self.rows_max}")
        return self._get(name, (self.rows_max, *tail), dtype, zero)[:rows]

    def fixed(self, name: str, shape: tuple, dtype=np.float32, zero: bool = False):
        """The buffer `name` of exactly `shape`."""
        return self._get(name, tuple(shape), dtype, zero)

    def _get(self, name, shape, dtype, zero):
        dtype = np.dtype(dtype)
        buf = self._backing.get(name)
        if buf is None:
            if self.owner is None:
                buf = (self.be.xp.zeros if zero else self.be.xp.empty)(shape, dtype)
            else:
                buf = (self.be.alloc.zeros if zero else self.be.alloc.empty)(shape, dtype, self.owner)
            self._backing[name] = buf
            self.fills += bool(zero)
        elif tuple(buf.shape) != shape or buf.dtype != dtype:
            raise ShapeError(f"workspace {self.owner!r}: {name} is {tuple(buf.shape)} {buf.dtype}, asked for {shape} "
                             f"{dtype} (two uses of one name)")
        return buf

    @property
    def bytes(self) -> int:
        return sum(int(b.nbytes) for b in self._backing.values())

    def __contains__(self, name: str) -> bool:
        return name in self._backing

    def free(self) -> int:
        """Release every buffer (the programs that recorded them must be dropped first)."""
        n = self.be.alloc.free_owner(self.owner) if self.owner is not None else self.bytes
        self._backing.clear()
        return n


def buffer(be, ws: Workspace | None, name: str, rows: int, tail: tuple = (), dtype=np.float32, zero: bool = False):
    """`name` of the workspace, or a fresh array of (rows, *tail) without one."""
    if ws is not None:
        return ws.take(name, rows, tail, dtype, zero)
    return (be.xp.zeros if zero else be.xp.empty)((rows, *tail), dtype)


def fixed(be, ws: Workspace | None, name: str, shape: tuple, dtype=np.float32, zero: bool = False):
    """`name` of exactly `shape` from the workspace, or a fresh array without one."""
    if ws is not None:
        return ws.fixed(name, shape, dtype, zero)
    return (be.xp.zeros if zero else be.xp.empty)(tuple(shape), dtype)


class Inputs:
    """Named fields (count, dtype) in one host buffer and one device buffer (8-byte aligned)."""

    def __init__(self, be, fields: dict, owner: str = "inputs"):
        self.be = be
        at, self._layout = 0, {}
        for name, (count, dtype) in fields.items():
            dtype = np.dtype(dtype)
            self._layout[name] = (at, int(count), dtype)
            at += -(-int(count) * dtype.itemsize // 8) * 8
        self.host = np.zeros(max(at, 8), np.uint8)
        self.device = self.host if be.xp is np else be.alloc.zeros(self.host.shape, np.uint8, owner)
        self._fields = {}
        for name, (at, count, dtype) in self._layout.items():
            n = count * dtype.itemsize
            self._fields[name] = Staged.of(self.host[at : at + n].view(dtype), self.device[at : at + n].view(dtype))

    def __getitem__(self, name: str) -> Staged:
        return self._fields[name]

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def scope(self, prefix: str) -> "Scope":
        """The fields named `prefix` + name, by their short names (one upload for two passes' fields)."""
        return Scope(self, prefix)

    def set(self, **values) -> "Inputs":
        """Write fields on the host (not uploaded yet)."""
        for name, v in values.items():
            self._fields[name].host[...] = v
        return self

    def upload(self) -> "Inputs":
        """One host->device copy of every field (nothing on the CPU backends: the same memory)."""
        if self.device is not self.host:
            self.device.set(self.host)
        return self

    @property
    def nbytes(self) -> int:
        return int(self.host.nbytes)


class Scope:
    """Fields of an Inputs under a prefix, addressed by their short names."""
    __slots__ = ("inputs", "prefix")

    def __init__(self, inputs: Inputs, prefix: str):
        self.inputs, self.prefix = inputs, prefix

    def __getitem__(self, name: str) -> Staged:
        return self.inputs[self.prefix + name]

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.inputs

    def set(self, **values) -> "Scope":
        self.inputs.set(**{self.prefix + k: v for k, v in values.items()})
        return self


class Outputs:
    """Named fields (count, dtype) of one device buffer: what a pass hands back to the host, read
    in ONE device->host copy (`fetch`). Kernels write the fields (device views); the round's two
    synchronisations are two fetches."""

    def __init__(self, be, fields: dict, ws: Workspace | None = None, name: str = "outputs"):
        self.be = be
        at, self._layout = 0, {}
        for field, (count, dtype) in fields.items():
            dtype = np.dtype(dtype)
            self._layout[field] = (at, int(count), dtype)
            at += -(-int(count) * dtype.itemsize // 8) * 8
        self.device = fixed(be, ws, name, (max(at, 8),), np.uint8)
        self._views = {f: self.device[a : a + n * dt.itemsize].view(dt) for f, (a, n, dt) in self._layout.items()}

    def __getitem__(self, field: str):
        return self._views[field]

    def fetch(self) -> dict:
        """Every field on the host, from one copy (one wait on the device)."""
        host = self.be.to_host(self.device)
        return {f: host[a : a + n * dt.itemsize].view(dt) for f, (a, n, dt) in self._layout.items()}
