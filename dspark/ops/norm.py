"""RMSNorm of rows, in one fixed order per row (kernels: csrc/norm.cu), alone, after the residual
add (`add_rmsnorm`) and after the embedding gather (`embed_rmsnorm`).

    y = x / sqrt(mean(x^2) + eps) * weight        over the last axis of x [..., n]

Row invariance (DESIGN section 3) needs each row's sum of squares taken in an order that depends
on n alone. NumPy's reduction over a contiguous last axis is pairwise per row, so the numpy
backend keeps its one-line formula (`rmsnorm_numpy`), run natively by dspark.ops.host.rmsnorm
with the same bits. CuPy's reductions choose their block layout
from the array's shape, so on a GPU a row's order could change with the number of rows: the simt
and cuda backends run `rmsnorm_f32`, one warp per row, lane l summing x[l]^2, x[l+32]^2, ... and an
xor butterfly. `rmsnorm_ref` is its NumPy twin, bit for bit (the kernel tests compare them with
array_equal); it and the numpy formula agree within a few ulp.

The gdn's gated output norm of a prompt (`rmsnorm_gated`): rmsnorm_f32's rows, each output times
SiLU of its gate, the gates read where the layer's projection holds them, in one launch (an RMSNorm and
six array operations before): bitwise the decode scan's gated norm.

The layer boundary: `add_rmsnorm` adds the sublayer's output to the residual stream x in place and
normalises the new x for the next sublayer in one launch (and copies x to a tap column block when
the layer is tapped); `embed_rmsnorm` gathers the first x from the embedding (f32, f16 or bf16,
widened exactly) and normalises it. Both sum exactly as rmsnorm_f32 does, over ceil(n / ROW_CHUNK)
CTAs a row: each writes its chunk of the new x with all its loads in flight at once (the one-warp
kernel waited out a round trip an entry), so a verify's few rows move their bytes on many SMs,
and the last of a row's CTAs to arrive (a ticket a row, zero at rest) stages the row from L2 and
norms it.
"""

from __future__ import annotations

import numpy as np

from ..arrays import adopt
from ..dtypes import suffix, to_f32
from ..errors import ShapeError
from . import dense, host, rowsplit
from .checks import host_and_device, require_dtype, require_ndim, require_shape

F32 = np.float32
WARPS = 1   # rows per CTA (kNormWarps): a verify's few rows on as many SMs
ROW_THREADS, ROW_CHUNK = 256, 1024  # add_ and embed_rmsnorm: a CTA's threads, the columns it writes (kRow*)
ROW_PIECE = 8192                    # floats the row's last CTA stages at once (kRowPiece)


def row_chunks(n: int) -> int:
    """CTAs a row of n takes in add_ and embed_rmsnorm (their grid's y)."""
    return max(1, -(-n // ROW_CHUNK))


def _row_step(be, kernel: str, args: tuple, rows: int, n: int, ws) -> None:
    """Launch a row kernel (grid (rows, row_chunks(n))) with its tickets: `rows` of them, zero at
    rest, from the workspace `ws` (what a recorded pass keeps) or the row-split pool."""
    if rows and n:
        tickets = ws.take("norm.tickets", rows, (), np.uint32, zero=True) if ws is not None else \
            rowsplit.scratch(be, rows)[0]
        rowsplit.launch(be, kernel, (rows, row_chunks(n)), ROW_THREADS, (*args, tickets))


def _butterfly(p: np.ndarray) -> np.ndarray:
    """Every lane's value after the xor butterfly over the last axis (32 lanes, offsets 16 .. 1)."""
    lane = np.arange(32)
    o = 16
    while o:
        p = p + p[..., lane ^ o]
        o //= 2
    return p


def rmsnorm_ref(x, weight, eps: float) -> np.ndarray:
    """The kernel's arithmetic on host rows x [..., n] f32, bitwise."""
    x = np.asarray(x, F32)
    n = x.shape[-1]
    padded = np.zeros(x.shape[:-1] + (-(-n // 32) * 32,), F32)
    padded[..., :n] = x
    padded = padded.reshape(x.shape[:-1] + (-1, 32))
    ss = np.zeros(x.shape[:-1] + (32,), F32)
    for r in range(padded.shape[-2]):  # lane l adds its entries in order
        ss = ss + padded[..., r, :] * padded[..., r, :]
    r = np.sqrt(_butterfly(ss)[..., :1] / F32(n) + F32(eps))
    return (x / r) * np.asarray(weight, F32)


def rmsnorm_numpy(x, weight, eps: float):
    """The numpy backend's RMSNorm: NumPy's own pairwise sum per row (row-invariant on NumPy)."""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + F32(eps))) * weight


def numpy_rmsnorm(x, weight, eps: float):
    """The numpy backend's RMSNorm: rmsnorm_numpy, natively where dspark._cpu is built (the same bits)."""
    return host.rmsnorm(x, weight, eps) if host.NATIVE else rmsnorm_numpy(x, weight, eps)


def rmsnorm(be, x, weight, eps: float, out=None):
    """RMSNorm of x [..., n] (f32) with weight [n] (f32) over the last axis -> f32 like x."""
    x, weight, out = adopt(be, x=x, weight=weight, out=out, writes=("out",))
    require_dtype(x, F32, "x")
    n = x.shape[-1] if x.ndim else 0
    require_shape(weight, (n,), "weight")
    require_dtype(weight, F32, "weight")
    if be.kernels is None:
        y = numpy_rmsnorm(x, weight, eps)
        if out is None:
            return y
        out[...] = y
        return out
    xp = be.xp
    x = xp.ascontiguousarray(x)
    if out is None:
        out = xp.empty(x.shape, F32)
    require_shape(out, x.shape, "out")
    require_dtype(out, F32, "out")
    rows = x.size // n if n else 0
    if rows:
        be.kernels.get_function("rmsnorm_f32")((-(-rows // WARPS),), (32 * WARPS,),
                                               (x, weight, np.int32(rows), np.int32(n), F32(eps), out))
    return out


def rmsnorm_gated_ref(x, z, weight, eps: float) -> np.ndarray:
    """rmsnorm_gated's arithmetic on host arrays, z [tokens, heads, n] the gates: rmsnorm_ref, then
    times SiLU(z) (dspark.ops.dense's formula), bitwise the kernel's up to the last bit of exp (the
    host's libm against expf)."""
    with np.errstate(over="ignore", invalid="ignore"):   # exp overflows to inf, -inf * 0 is NaN: as on the device
        return rmsnorm_ref(x, weight, eps) * dense.silu(np.asarray(z, F32))


def rmsnorm_gated(be, x, gates, weight, eps: float, out=None, *, column: int = 0):
    """out = RMSNorm(x) * SiLU(z) of x [tokens, heads, n] f32 (C-contiguous), z the gates that
    gates [tokens, width] f32 (C-contiguous) holds at columns [column, column + heads n) of each token:
    the gdn's projection, read in place (dspark.models.trunk's prompt gdn). One launch of
    rmsnorm_gated_f32 (a warp a row of n); the numpy backend keeps its formula."""
    x, gates, weight, out = adopt(be, x=x, gates=gates, weight=weight, out=out, writes=("out",))
    require_ndim(x, 3, "x", "[tokens, heads, n]")
    require_dtype(x, F32, "x")
    tokens, heads, n = x.shape
    require_ndim(gates, 2, "gates", "[tokens, width]")
    require_dtype(gates, F32, "gates")
    if gates.shape[0] != tokens or not 0 <= column <= gates.shape[1] - heads * n:
        raise ShapeError(f"gates has shape {tuple(gates.shape)}: expected {tokens} rows holding {heads} x {n} "
                         f"gates from column {column}")
    require_shape(weight, (n,), "weight")
    require_dtype(weight, F32, "weight")
    if out is None:
        out = be.xp.empty(x.shape, F32)
    require_shape(out, x.shape, "out")
    require_dtype(out, F32, "out")
    z = gates[:, column : column + heads * n].reshape(tokens, heads, n)
    if be.kernels is None:
        out[...] = numpy_rmsnorm(x, weight, eps) * dense.silu(z)
        return out
    x, gates = be.xp.ascontiguousarray(x), be.xp.ascontiguousarray(gates)
    rows = tokens * heads
    if rows:
        be.kernels.get_function("rmsnorm_gated_f32")(
            (-(-rows // WARPS),), (32 * WARPS,),
            (x, gates, np.int64(gates.shape[1]), np.int64(column), np.int32(heads), weight, np.int32(rows),
             np.int32(n), F32(eps), out))
    return out


def _tap(tap, rows: int, n: int):
    """(the kernel's tap pointer, row stride) of tap = (taps [rows, width] f32, column): the new x
    goes to taps[:, column : column + n]."""
    if tap is None:
        return None, np.int64(0)
    taps, col = tap  # (adopted by the caller)
    require_ndim(taps, 2, "taps", "[rows, width]")
    require_dtype(taps, F32, "taps")
    if taps.shape[0] != rows or not 0 <= col <= taps.shape[1] - n or not taps.flags.c_contiguous:
        raise ShapeError(f"taps has shape {tuple(taps.shape)}: expected a C-contiguous ({rows}, >= {col} + {n}) "
                         f"array for the column block at {col}")
    return taps.reshape(-1)[col:], np.int64(taps.shape[1])


def add_rmsnorm_ref(x, y, weight, eps: float):
    """(new x, rmsnorm of it) of host rows, the kernel's arithmetic bitwise."""
    x = np.asarray(x, F32) if y is None else np.asarray(x, F32) + np.asarray(y, F32)
    return x, rmsnorm_ref(x, weight, eps)


def add_rmsnorm(be, x, y, weight, eps: float, out=None, tap=None, ws=None):
    """x <- x + y in place (y None: x as it is), then out = RMSNorm of the new x; with tap =
    (taps, column) the new x is also copied to taps[:, column : column + n]. x, y [rows, n] f32 (x
    C-contiguous: it is written), weight [n] f32; out may be x. `ws`: the workspace the row tickets
    come from (dspark.ops.workspace; default the row-split pool)."""
    x, y, weight, out = adopt(be, x=x, y=y, weight=weight, out=out, writes=("x", "out"))
    tap = None if tap is None else (adopt(be, taps=tap[0], writes=("taps",)), tap[1])
    require_ndim(x, 2, "x", "[rows, n]")
    require_dtype(x, F32, "x")
    rows, n = x.shape
    if y is not None:
        require_shape(y, (rows, n), "y")
        require_dtype(y, F32, "y")
    require_shape(weight, (n,), "weight")
    require_dtype(weight, F32, "weight")
    if out is None:
        out = be.xp.empty((rows, n), F32)
    require_shape(out, (rows, n), "out")
    require_dtype(out, F32, "out")
    tap_ptr, stride = _tap(tap, rows, n)
    if be.kernels is None:
        if y is not None:
            x += y
        out[...] = numpy_rmsnorm(x, weight, eps)
        if tap is not None:
            tap[0][:, tap[1] : tap[1] + n] = x
        return out
    if not x.flags.c_contiguous:
        raise ShapeError("x: expected a C-contiguous array (it is written in place)")
    y = None if y is None else be.xp.ascontiguousarray(y)
    _row_step(be, "add_rmsnorm_f32", (x, y, weight, np.int32(rows), np.int32(n), F32(eps), out, tap_ptr, stride),
              rows, n, ws)
    return out


def embed_rmsnorm(be, table, ids, weight, eps: float, x=None, out=None, scale: float = 1.0, tap=None, ws=None):
    """x = widen(table[ids]) * scale [rows, n] f32, then out = RMSNorm(x); the tap copy and `ws` as
    in add_rmsnorm. table [V, n] f32/f16/bf16; ids int32 [rows], host or Staged (validated on the
    host, read by the kernel from the device). Returns (x, out)."""
    table, weight, x, out = adopt(be, table=table, weight=weight, x=x, out=out, writes=("x", "out"))
    tap = None if tap is None else (adopt(be, taps=tap[0], writes=("taps",)), tap[1])
    require_ndim(table, 2, "table", "[V, n]")
    suf = suffix(table.dtype, "table")
    n = table.shape[1]
    host_ids, dev_ids = host_and_device(be, ids, "ids")
    require_ndim(host_ids, 1, "ids", "[rows]")
    require_dtype(host_ids, np.int32, "ids")
    rows = host_ids.shape[0]
    if np.any((host_ids < 0) | (host_ids >= table.shape[0])):
        raise ShapeError(f"ids: expected token ids in [0, {table.shape[0]})")
    require_shape(weight, (n,), "weight")
    require_dtype(weight, F32, "weight")
    xp = be.xp
    x = xp.empty((rows, n), F32) if x is None else x
    out = xp.empty((rows, n), F32) if out is None else out
    for arr, what in ((x, "x"), (out, "out")):
        require_shape(arr, (rows, n), what)
        require_dtype(arr, F32, what)
    tap_ptr, stride = _tap(tap, rows, n)
    if be.kernels is None:
        x[...] = to_f32(table[host_ids]) * F32(scale)
        out[...] = numpy_rmsnorm(x, weight, eps)
        if tap is not None:
            tap[0][:, tap[1] : tap[1] + n] = x
        return x, out
    _row_step(be, f"embed_rmsnorm_{suf}", (xp.ascontiguousarray(table), dev_ids, np.int32(rows), np.int32(n),
                                            F32(scale), weight, F32(eps), x, out, tap_ptr, stride), rows, n, ws)
    return x, out
