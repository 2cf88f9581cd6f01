"""KV commit: copy rows [0, keep_b) of each session's verify scratch into its cache at pos_b, for
every attention layer in one launch (kernel: csrc/kv_commit.cu).

Scratch, per layer: [rows, Hkv, D], ragged over sessions by `row_indptr` (the layout of the
attention op's block K/V). Cache, per (layer, session): [Hkv, capacity, D]. With ``ring=True``
(the drafter's KV) absolute position p lands in slot p % capacity.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import suffix
from .. import profile
from ..errors import CapacityError, DTypeError, ShapeError, StateError
from ..arrays import adopt
from .checks import Staged, require_dense, require_dtype, require_indptr, require_ndim, require_shape

THREADS = 128


# ---- NumPy reference ------------------------------------------------------------------------
def kv_commit_ref(k_blk, v_blk, k_caches, v_caches, pos, keep, row_indptr, *, ring=False) -> None:
    """In place, on NumPy arrays."""
    for blks, caches in ((k_blk, k_caches), (v_blk, v_caches)):
        for blk, layer in zip(blks, caches):
            for b, cache in enumerate(layer):
                r0, n = int(row_indptr[b]), int(keep[b])
                slots = int(pos[b]) + np.arange(n)
                cache[:, slots % cache.shape[1] if ring else slots] = blk[r0 : r0 + n].transpose(1, 0, 2)


def commit_bytes(layers: int, rows: int, hkv: int, head_dim: int, itemsize: int) -> int:
    """Bytes kv_commit moves for `rows` kept rows (all sessions): K and V of every layer, read from
    the scratch and written to the cache. profiling/perf_model.py prices the same."""
    return 2 * 2 * layers * rows * hkv * head_dim * itemsize


# ---- validation -------------------------------------------------------------------------------
def _require_list(x, n: int | None, what: str, layout: str) -> None:
    if not isinstance(x, (list, tuple)) or (n is not None and len(x) != n):
        got = len(x) if isinstance(x, (list, tuple)) else type(x).__name__
        raise ShapeError(f"{what} has {got} entries: expected a list of {layout}")


def _validate(be, k_blk, v_blk, k_caches, v_caches, pos, keep, row_indptr, ring):
    """-> (row_indptr, pos, keep, capacity [L * B]) as host int32 arrays."""
    _require_list(k_blk, None, "k_blk", "[rows, Hkv, D] arrays, one per layer")
    layers = len(k_blk)
    if layers == 0:
        raise ShapeError("k_blk is empty: expected one [rows, Hkv, D] array per layer")
    _require_list(v_blk, layers, "v_blk", f"{layers} arrays (one per layer, as k_blk)")
    require_ndim(k_blk[0], 3, "k_blk[0]", "[rows, Hkv, D]")
    shape, dtype = tuple(k_blk[0].shape), k_blk[0].dtype
    suffix(dtype, "k_blk[0]")
    rows, hkv, d = shape
    if (d * dtype.itemsize) % 16:
        raise ShapeError(f"k_blk[0] rows of {d} x {dtype.itemsize} bytes: expected a multiple of 16 bytes")
    for name, blks in (("k_blk", k_blk), ("v_blk", v_blk)):
        for layer, a in enumerate(blks):
            require_shape(a, shape, f"{name}[{layer}]")
            _require_dtype_of(a, dtype, f"{name}[{layer}]")
    indptr = be.to_host(row_indptr)
    require_indptr(indptr, "row_indptr", rows)
    sessions = indptr.shape[0] - 1
    host = []
    for name, a in (("pos", pos), ("keep", keep)):
        a = be.to_host(a)
        require_ndim(a, 1, name, "[B]")
        require_dtype(a, np.int32, name)
        require_shape(a, (sessions,), name)
        if np.any(a < 0):
            b = int(np.flatnonzero(a < 0)[0])
            raise CapacityError(f"{name}[{b}]={int(a[b])}: expected >= 0")
        host.append(a)
    pos, keep = host
    lengths = np.diff(indptr)
    if np.any(keep > lengths):
        b = int(np.flatnonzero(keep > lengths)[0])
        raise CapacityError(f"keep[{b}]={int(keep[b])} exceeds the {int(lengths[b])} scratch rows of session {b}")
    capacity = np.zeros((layers, sessions), np.int32)
    for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        _require_list(caches, layers, name, f"{layers} lists (one per layer) of {sessions} caches")
        for layer, per_session in enumerate(caches):
            _require_list(per_session, sessions, f"{name}[{layer}]", f"{sessions} caches (one per session)")
            for b, c in enumerate(per_session):
                what = f"{name}[{layer}][{b}]"
                require_ndim(c, 3, what, "[Hkv, capacity, D]")
                if c.shape[0] != hkv or c.shape[2] != d:
                    raise ShapeError(f"{what} has shape {tuple(c.shape)}: expected ({hkv}, capacity, {d})")
                _require_dtype_of(c, dtype, what)
                if name == "v_caches":
                    require_shape(c, k_caches[layer][b].shape, what)
                capacity[layer, b] = c.shape[1]
    for layer in range(layers):
        for b in range(sessions):
            cap, end = int(capacity[layer, b]), int(pos[b]) + int(keep[b])
            if ring and int(keep[b]) > cap:
                raise CapacityError(f"keep[{b}]={int(keep[b])} exceeds the ring capacity {cap} of "
                                    f"k_caches[{layer}][{b}]: rows would overwrite each other")
            if not ring and end > cap:
                raise CapacityError(f"session {b}: pos={int(pos[b])} + keep={int(keep[b])} exceeds the capacity "
                                    f"{cap} of k_caches[{layer}][{b}]")
            if end > np.iinfo(np.int32).max:
                raise CapacityError(f"session {b}: pos + keep must fit in int32")
    return indptr, pos, keep, capacity.reshape(-1)


def require_kernel_buffers(be, arrays, names, writable: bool = False) -> None:
    for a, name in zip(arrays, names):
        require_dense(be, a, name, writable=writable)


def _require_dtype_of(a, dtype, what: str) -> None:
    if a.dtype != dtype:
        raise DTypeError(f"{what} has dtype {a.dtype}: expected {dtype} (the dtype of k_blk[0])")


# ---- the op -----------------------------------------------------------------------------------
def kv_commit(be, k_blk, v_blk, k_caches, v_caches, pos, keep, row_indptr, *, ring=False, table=None,
              blk_table=None, capacity=None) -> None:
    """Copy scratch rows [0, keep_b) of session b to cache slots pos_b.. (mod capacity if `ring`).

    k_blk / v_blk: lists over layers of [rows, Hkv, D]; k_caches / v_caches: lists over layers of
    lists over sessions of [Hkv, capacity, D]; pos, keep: int32 [B]; row_indptr: int32 [B+1].
    `table`: a PointerTable (dspark.ops.tables) of exactly the caches, k then v, layer by layer,
    made earlier for this batch; its addresses are used instead of uploading new ones (a table
    of other arrays is refused). Everything is checked before anything is written.

    A recorded or captured pass: pos, keep, row_indptr and `capacity` (int32 [L * B], each cache's
    rows, layer-major) as Staged arrays are read from their device copies, and `blk_table` (a
    PointerTable of the scratch arrays, k then v) replaces the per-call upload of their addresses:
    nothing is uploaded and a keep of 0 everywhere still launches (the grid reads keep on the device).
    """
    staged = all(isinstance(a, Staged) for a in (pos, keep, row_indptr, capacity))
    k_blk, v_blk, k_caches, v_caches = adopt(be, k_blk=k_blk, v_blk=v_blk, k_caches=k_caches, v_caches=v_caches,
                                             writes=("k_caches", "v_caches"))
    if not staged:
        pos, keep, row_indptr = adopt(be, pos=pos, keep=keep, row_indptr=row_indptr)
    pos_arg, keep_arg, capacity_arg = pos, keep, capacity
    indptr, pos, keep, capacity = _validate(be, k_blk, v_blk, k_caches, v_caches, pos, keep, row_indptr, ring)
    _, hkv, d = k_blk[0].shape
    profile.moved("kv_commit", commit_bytes(len(k_blk), int(keep.sum()), hkv, d, k_blk[0].dtype.itemsize))
    if be.kernels is None:
        kv_commit_ref(k_blk, v_blk, k_caches, v_caches, pos, keep, indptr, ring=ring)
        return
    layers, B = len(k_blk), indptr.shape[0] - 1
    if not keep.any() and not staged:
        return
    blks = [be.xp.ascontiguousarray(a) for a in (*k_blk, *v_blk)]
    caches = [c for layer in k_caches for c in layer] + [c for layer in v_caches for c in layer]
    require_kernel_buffers(be, blks, [f"{kv}_blk[{i}]" for kv in "kv" for i in range(layers)])
    if table is not None:
        if len(table.arrays) != len(caches) or any(a is not c for a, c in zip(table.arrays, caches)):
            raise StateError("kv_commit: `table` holds other arrays than k_caches / v_caches (a stale table)")
        table.require("table", writable=True, align=16)
    else:
        require_kernel_buffers(be, caches, [f"{kv}_caches[{i}][{b}]" for kv in "kv" for i in range(layers)
                                            for b in range(B)], writable=True)
    _, hkv, d = k_blk[0].shape
    if staged:
        if not np.array_equal(capacity_arg.host, capacity):
            raise ShapeError(f"capacity={capacity_arg.host.tolist()}: expected the caches' rows {capacity.tolist()}")
        args = (row_indptr.device, pos_arg.device, keep_arg.device, capacity_arg.device)
    else:  # one upload for the small per-session arrays; views of it are the kernel's arguments
        meta = be.asarray(np.concatenate([indptr, pos, keep, capacity]).astype(np.int32))
        args = (meta[: B + 1], meta[B + 1 : 2 * B + 1], meta[2 * B + 1 : 3 * B + 1], meta[3 * B + 1 :])
    if blk_table is not None:
        if len(blk_table.arrays) != len(blks) or any(a is not b for a, b in zip(blk_table.arrays, (*k_blk, *v_blk))):
            raise StateError("kv_commit: `blk_table` holds other arrays than k_blk / v_blk (a stale table)")
        src = blk_table.device
    else:
        src = be.pointer_table(blks)
    fn = be.kernels.get_function("kv_commit_rows")
    fn((B, layers, 2), (THREADS,),
       (src, be.pointer_table(caches) if table is None else table.device, *args, np.int32(hkv),
        np.int32(d * k_blk[0].dtype.itemsize // 16), np.int32(ring)))
