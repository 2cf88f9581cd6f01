"""Snapshot, restore and checkpoint select of recurrent state (kernels: csrc/snapshot.cu).

A hybrid trunk's gdn layers carry state that a length truncation cannot undo: the delta-rule
matrix state [H, dv, dk] and the conv window [C, 3] of every session. After a partial accept
(keep < vt) it must be exactly the state after `keep` verify columns. Two ways, bitwise equal:

1. `snapshot_save` before the verify, then `snapshot_restore` and replay the `keep` kept columns
   with `gdn_scan` (dspark/ops/gdn.py);
2. run the verify with per-column checkpoints and `checkpoint_select` column keep - 1.

The session needs no snapshot: its verify runs gdn_scan with commit=False, which reads the live
state and never writes it, so the live state is the snapshot; the rollback replays the kept
columns from it or selects the kept column's checkpoint (`committed=False`: keep 0 leaves it).

Every op here is one launch for every tensor of every session, through pointer tables. The NumPy
functions are plain copies: the numpy backend's implementation and the oracle.
"""

from __future__ import annotations

import numpy as np

from .. import profile
from ..errors import CapacityError, DTypeError, ShapeError, StateError
from ..arrays import adopt
from .checks import host_and_device, require_dense, require_dtype, require_indptr, require_ndim, require_shape
from .tables import PointerTable, as_table

COPY_THREADS = 256
COPY_CHUNK = COPY_THREADS * 4 * 4  # floats per block: four float4 steps per thread
MAX_CHUNKS = 65535                 # grid.y limit; the copy loop strides over the rest


def copy_grid(tensors: int, largest: int) -> tuple[int, int]:
    """(tensors, chunks): one grid column per tensor, enough blocks for the largest one."""
    return tensors, max(1, min(MAX_CHUNKS, -(-largest // COPY_CHUNK)))


def require_tensor(be, a, what: str, shape: tuple | None = None, writable: bool = True, align: int = 4) -> None:
    """A recurrent tensor a kernel indexes densely: an f32 array of the backend, C-contiguous,
    writable when written, of `shape` when given, starting at a multiple of `align` bytes
    (kernels that move float4 need 16)."""
    if not isinstance(a, be.xp.ndarray):
        raise DTypeError(f"{what} is a {type(a).__name__}: expected a {be.xp.__name__}.ndarray")
    require_dtype(a, np.float32, what)
    if shape is not None:
        require_shape(a, shape, what)
    require_dense(be, a, what, writable=writable, align=align)


def require_table(be, arrays, what: str, count: int | None = None, shape: tuple | None = None,
                  writable: bool = True, align: int = 4) -> PointerTable:
    """The arrays behind a `float* const*` pointer table: a list (of `count`, one per session),
    each passing require_tensor, or a PointerTable of such arrays (dspark.ops.tables)."""
    return as_table(be, arrays, what, count=count, shape=shape, dtype=np.float32, writable=writable, align=align)


def select_bytes(sessions: int, state_size: int, conv_size: int) -> int:
    """Bytes checkpoint_select moves for `sessions` copied sessions of one layer: the checkpoint
    read, the live state and conv window written (f32). profiling/perf_model.py prices the same."""
    return 2 * 4 * sessions * (state_size + conv_size)


# ---- NumPy reference ------------------------------------------------------------------------
def checkpoint_select_ref(state_ckpt, conv_ckpt, states, conv_windows, col_indptr, keep,
                          snap_states=None, snap_convs=None) -> None:
    """Session b's live state <- checkpoint column col_indptr[b] + keep[b] - 1, or its snapshot
    when keep[b] = 0 (left alone when no snapshot is given)."""
    for b, k in enumerate(np.asarray(keep).tolist()):
        if k >= 1:
            col = int(col_indptr[b]) + k - 1
            states[b][...], conv_windows[b][...] = state_ckpt[col], conv_ckpt[col]
        elif snap_states is not None:
            states[b][...], conv_windows[b][...] = snap_states[b], snap_convs[b]


# ---- ops ------------------------------------------------------------------------------------
def _copy(be, src, dst, src_name: str, dst_name: str) -> None:
    if not isinstance(src, PointerTable):
        src = adopt(be, **{src_name: src})
    if not isinstance(dst, PointerTable):
        dst = adopt(be, **{dst_name: dst}, writes=(dst_name,))
    src = require_table(be, src, src_name, writable=False)
    dst = require_table(be, dst, dst_name, count=len(src))
    for i, (s, d) in enumerate(zip(src.shapes, dst.shapes)):
        if d != s:
            raise ShapeError(f"{dst_name}[{i}] has shape {d}: expected {s} as {src_name}[{i}]")
    nbytes = 2 * sum(a.nbytes for a in src.arrays)
    if be.kernels is None:
        for s, d in zip(src.arrays, dst.arrays):
            d[...] = s
    elif len(src):
        sizes = be.asarray(np.array([a.size for a in src.arrays], np.int64))
        fn = be.kernels.get_function("snapshot_copy_f32")
        fn(copy_grid(len(src), max(a.size for a in src.arrays)), (COPY_THREADS,),
           (src.device, dst.device, sizes, np.int32(len(src))))
    profile.moved("rollback", nbytes)


def snapshot_save(be, live, snap) -> None:
    """snap[i][...] = live[i] for every i, in one launch. `live` and `snap` are lists of f32
    recurrent tensors (states and conv windows of every gdn layer of every session), paired by
    index."""
    _copy(be, live, snap, "live", "snap")


def snapshot_restore(be, snap, live) -> None:
    """live[i][...] = snap[i] for every i, in one launch (the inverse of snapshot_save)."""
    _copy(be, snap, live, "snap", "live")


def checkpoint_select(be, state_ckpt, conv_ckpt, states, conv_windows, col_indptr, keep, *,
                      snap_states=None, snap_convs=None, committed: bool = True) -> None:
    """Roll each session of one gdn layer back to the state after its first keep[b] verify columns.

    `state_ckpt` [cols, H, dv, dk] and `conv_ckpt` [cols, C, 3] are the per-column checkpoints
    of the verify (gdn_scan's state_ckpt / conv_ckpt), `col_indptr` [B+1] its columns per
    session; `states` and `conv_windows` the B live tensors; `keep` int32 [B] in
    [0, columns of b]. col_indptr and keep may be host or device arrays.

    keep[b] >= 1 copies checkpoint column col_indptr[b] + keep[b] - 1. keep[b] = 0 keeps nothing
    of the verify, so the state must become the one before it: the snapshot. Pass that session's
    snapshot as snap_states / snap_convs (lists of B, like `states` / `conv_windows`; entries of
    sessions with keep >= 1 are not read) and it is copied in the same launch. Without snapshots
    a keep of 0 raises StateError rather than leave the post-verify state live, unless the verify
    never wrote the live state (`committed=False`: gdn_scan with commit=False, as the session's
    verify runs): then keep 0 leaves that session's live state as it is, the state before the
    verify. states and conv_windows may be PointerTables (dspark.ops.tables).
    """
    state_ckpt, conv_ckpt, col_indptr, keep = adopt(be, state_ckpt=state_ckpt, conv_ckpt=conv_ckpt,
                                                    col_indptr=col_indptr, keep=keep)
    if not isinstance(states, PointerTable):
        states = adopt(be, states=states, writes=("states",))
    if not isinstance(conv_windows, PointerTable):
        conv_windows = adopt(be, conv_windows=conv_windows, writes=("conv_windows",))
    if snap_states is not None and not isinstance(snap_states, PointerTable):
        snap_states = adopt(be, snap_states=snap_states)
    if snap_convs is not None and not isinstance(snap_convs, PointerTable):
        snap_convs = adopt(be, snap_convs=snap_convs)
    require_ndim(state_ckpt, 4, "state_ckpt", "[cols, H, dv, dk]")
    require_dtype(state_ckpt, np.float32, "state_ckpt")
    require_ndim(conv_ckpt, 3, "conv_ckpt", "[cols, C, 3]")
    require_dtype(conv_ckpt, np.float32, "conv_ckpt")
    cols = state_ckpt.shape[0]
    require_shape(conv_ckpt, (cols, conv_ckpt.shape[1], 3), "conv_ckpt")
    host_indptr, dev_indptr, host_keep, dev_keep = _kept_columns(be, col_indptr, keep, cols)
    B = host_indptr.shape[0] - 1
    state_shape, conv_shape = tuple(state_ckpt.shape[1:]), tuple(conv_ckpt.shape[1:])
    states = require_table(be, states, "states", B, state_shape)
    conv_windows = require_table(be, conv_windows, "conv_windows", B, conv_shape)
    if (snap_states is None) != (snap_convs is None):
        raise ShapeError("snap_states and snap_convs go together: pass both or neither")
    if snap_states is not None:
        snap_states = require_table(be, snap_states, "snap_states", B, state_shape, writable=False)
        snap_convs = require_table(be, snap_convs, "snap_convs", B, conv_shape, writable=False)
    zero = np.flatnonzero(host_keep == 0)
    if zero.size and snap_states is None and committed:
        b = int(zero[0])
        raise StateError(f"keep[{b}]=0 rolls session {b} back to before the verify: pass snap_states "
                         f"and snap_convs (the snapshot taken before it)")
    state_size, conv_size = int(np.prod(state_shape)), int(np.prod(conv_shape))
    copied = int(np.count_nonzero((host_keep >= 1) | (snap_states is not None)))
    if be.kernels is None:
        checkpoint_select_ref(state_ckpt, conv_ckpt, list(states.arrays), list(conv_windows.arrays), host_indptr,
                              host_keep, None if snap_states is None else list(snap_states.arrays),
                              None if snap_convs is None else list(snap_convs.arrays))
    elif B:
        tables = [None, None] if snap_states is None else [snap_states.device, snap_convs.device]
        fn = be.kernels.get_function("checkpoint_select_f32")
        fn(copy_grid(B, state_size), (COPY_THREADS,),
           (state_ckpt, conv_ckpt, states.device, conv_windows.device, *tables, dev_indptr, dev_keep,
            np.int64(state_size), np.int32(conv_size)))
    profile.moved("rollback", select_bytes(copied, state_size, conv_size))


def _kept_columns(be, col_indptr, keep, cols: int):
    """(host, device) col_indptr over `cols` verify columns and (host, device) keep [B], each keep
    within its session's columns."""
    host_indptr, dev_indptr = host_and_device(be, col_indptr, "col_indptr")
    require_indptr(host_indptr, "col_indptr", cols)
    B = host_indptr.shape[0] - 1
    host_keep, dev_keep = host_and_device(be, keep, "keep")
    require_ndim(host_keep, 1, "keep", "[B]")
    require_dtype(host_keep, np.int32, "keep")
    require_shape(host_keep, (B,), "keep")
    t = np.diff(host_indptr)
    bad = np.flatnonzero((host_keep < 0) | (host_keep > t))
    if bad.size:
        b = int(bad[0])
        raise CapacityError(f"keep[{b}]={int(host_keep[b])} is outside [0, {int(t[b])}]: session {b} "
                            f"has {int(t[b])} verify columns")
    return host_indptr, dev_indptr, host_keep, dev_keep


def checkpoint_select_layers(be, state_ckpts, conv_ckpts, states, conv_windows, col_indptr, keep) -> None:
    """checkpoint_select (committed=False) of every gdn layer in one launch: for layer l, session b
    keeps the checkpoint after its first keep[b] columns, or (keep 0) its live state, which a verify
    never writes. state_ckpts / conv_ckpts: per layer [cols, H, dv, dk] / [cols, C, 3] (lists or
    PointerTables of the layers' arrays); states / conv_windows: L * B live tensors, entry l * B + b
    for layer l of session b (lists or PointerTables). col_indptr and keep as checkpoint_select."""
    if not isinstance(state_ckpts, PointerTable):
        state_ckpts = adopt(be, state_ckpts=state_ckpts)
    if not isinstance(conv_ckpts, PointerTable):
        conv_ckpts = adopt(be, conv_ckpts=conv_ckpts)
    state_ckpts = require_table(be, state_ckpts, "state_ckpts", writable=False, align=16)
    layers = len(state_ckpts)
    conv_ckpts = require_table(be, conv_ckpts, "conv_ckpts", count=layers, writable=False)
    if not layers:
        return
    cols, *state_shape = state_ckpts.shapes[0]
    _, *conv_shape = conv_ckpts.shapes[0]
    for name, table, shape in (("state_ckpts", state_ckpts, state_shape), ("conv_ckpts", conv_ckpts, conv_shape)):
        for i, s in enumerate(table.shapes):
            if s != (cols, *shape):
                raise ShapeError(f"{name}[{i}] has shape {s}: expected {(cols, *shape)} as {name}[0]")
    host_indptr, dev_indptr, host_keep, dev_keep = _kept_columns(be, col_indptr, keep, cols)
    B = host_indptr.shape[0] - 1
    if not isinstance(states, PointerTable):
        states = adopt(be, states=states, writes=("states",))
    if not isinstance(conv_windows, PointerTable):
        conv_windows = adopt(be, conv_windows=conv_windows, writes=("conv_windows",))
    states = require_table(be, states, "states", layers * B, tuple(state_shape), align=16)
    conv_windows = require_table(be, conv_windows, "conv_windows", layers * B, tuple(conv_shape))
    state_size, conv_size = int(np.prod(state_shape)), int(np.prod(conv_shape))
    if be.kernels is None:
        for layer in range(layers):
            checkpoint_select_ref(state_ckpts.arrays[layer], conv_ckpts.arrays[layer],
                                  list(states.arrays[layer * B : (layer + 1) * B]),
                                  list(conv_windows.arrays[layer * B : (layer + 1) * B]), host_indptr, host_keep)
    elif B:
        fn = be.kernels.get_function("checkpoint_select_layers_f32")
        fn(copy_grid(layers * B, state_size), (COPY_THREADS,),
           (state_ckpts.device, conv_ckpts.device, states.device, conv_windows.device, dev_indptr, dev_keep,
            np.int32(B), np.int64(state_size), np.int32(conv_size)))
    profile.moved("rollback", layers * select_bytes(int(np.count_nonzero(host_keep)), state_size, conv_size))
