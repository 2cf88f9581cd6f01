"""The model's GEMM, out f32 [rows, N] = x f32 [rows, K] @ w [K, N] (kernel: csrc/linear.cu).

Weights stay as stored (f32, f16 or bf16) and the math is f32. Row invariance (DESIGN section 3)
needs each output's summation order to be a function of the shapes alone, never of `rows`:

* simt and cuda run `linear_<dt>`: column tiles of 32 16-byte vectors per CTA, K cut into
  `splits` chunks of `kchunk` rows (`split_plan`: from K and N alone, enough CTAs to fill an
  H200 at one row), 4 warps per chunk; the last CTA of a tile adds the chunks'
  partials in index order. It reads each weight once per 16 rows (ROW_TILE), at its stored width.
  `linear_ref` is its NumPy twin, bit for bit (the kernel tests compare them with array_equal).
* numpy runs dspark.ops.product: native code (dspark._cpu) summing each output in k order, its
  NumPy twin `product_ref` bit for bit, no padding, the weights read as stored.
* `linear_numpy` is the product in fixed-shape BLAS chunks of ROW_CHUNK rows, zero-padded (BLAS
  picks its algorithm, and so its order, by shape: a plain `x @ w` over a batch is not
  row-invariant, a fixed [ROW_CHUNK, K] x [K, N] product is): the yardstick the tests hold both
  orders to. Any two of them agree within f32 rounding: |a - b| <= 1e-5 * (|x| @ |w|) for K up to
  a few thousand (TOLERANCE).

`linear_plan` gives the kernel's launch and bytes for given shapes without running anything.
"""

from __future__ import annotations

import numpy as np

from ..arrays import adopt
from ..dtypes import suffix
from ..errors import ShapeError
from . import product, rowsplit
from .checks import require_dtype, require_ndim, require_shape
from .dense import widen
from .rowsplit import Launch, Plan
from .workspace import buffer, fixed

F32 = np.float32
ROW_CHUNK = 8          # the numpy backend's fixed GEMM shape: [ROW_CHUNK, K] x [K, N]
WARPS = 4              # kLinearWarps: a CTA's warps, each over its own ks of the chunk
THREADS = 32 * WARPS
ROW_TILE = 16          # kLinearRowTile: rows per pass over the weights (two sessions of 8 columns)
SMEM_ROWS = 8          # kLinearSmemRows: rows of a tile whose warp sums share memory at once
TARGET_CTAS = 256      # about two per SM of an H200: the split's aim at one row tile
MIN_CHUNK = 256        # rows of w a split takes at least (64 per warp: the weight loads stay in flight)
TOLERANCE = 1e-5       # linear_numpy vs the kernel: relative to |x| @ |w|


def cols_per_cta(itemsize: int) -> int:
    """Columns of a CTA tile: one 16-byte vector per lane of a warp."""
    return 32 * (16 // itemsize)


def tiles(n: int, itemsize: int) -> int:
    """Column tiles of w [K, N] with `itemsize`-byte entries: one CTA column each."""
    return max(1, -(-n // cols_per_cta(itemsize)))


def split_plan(k: int, n: int) -> tuple[int, int]:
    """(splits, kchunk) of w [K, N]: enough K splits that the 16-bit tiles of N times the splits
    reach TARGET_CTAS, each at least MIN_CHUNK rows of w; kchunk = ceil(K / splits). A function
    of (K, N) alone: never of the rows, nor of the storage dtype, so a 16-bit matrix gives bitwise
    the product of its f32 widening."""
    want = -(-TARGET_CTAS // tiles(n, 2))
    return chunking(k, max(1, min(want, k // MIN_CHUNK)))


def chunking(k: int, splits: int) -> tuple[int, int]:
    """(splits, kchunk) for K cut into about `splits` equal chunks: kchunk = ceil(K / splits) >= 1,
    splits recounted so that none is empty."""
    kchunk = max(1, -(-k // max(1, splits)))
    return max(1, -(-k // kchunk)), kchunk


# ---- NumPy ------------------------------------------------------------------------------------------
def linear_ref(x, w, kchunk: int) -> np.ndarray:
    """The kernel's arithmetic on host arrays, bitwise (csrc/linear.cu's header: per split, warp g
    sums k = lo + g, lo + g + 4, ... in order; the warps' sums are added 0..3, then the splits' in
    index order). Splits of `kchunk` rows of w."""
    x = np.asarray(x, F32)
    wf = np.asarray(widen(np.asarray(w)), F32)
    rows, k = x.shape
    n = wf.shape[1]
    out = None
    for lo in range(0, max(k, 1), kchunk):
        hi = min(k, lo + kchunk)
        part = None
        for g in range(WARPS):
            acc = np.zeros((rows, n), F32)
            for kk in range(lo + g, hi, WARPS):
                acc = acc + x[:, kk : kk + 1] * wf[kk]
            part = acc if part is None else part + acc
        out = part if out is None else out + part
    return out


def linear_numpy(x, w):
    """The numpy backend's product: fixed [ROW_CHUNK, K] x [K, N] BLAS chunks (zero-padded), f32."""
    w = widen(w)
    rows, k = x.shape
    out = np.empty((rows, w.shape[1]), dtype=F32)
    if rows == 0:
        return out
    full = rows - rows % ROW_CHUNK
    for r in range(0, full, ROW_CHUNK):
        out[r : r + ROW_CHUNK] = x[r : r + ROW_CHUNK] @ w
    if full < rows:
        pad = np.zeros((ROW_CHUNK, k), dtype=x.dtype)
        pad[: rows - full] = x[full:]
        out[full:] = (pad @ w)[: rows - full]
    return out


# ---- the op -----------------------------------------------------------------------------------------
def linear(be, x, w, out=None, *, splits: int | None = None, ws=None):
    """x [rows, K] f32 @ w [K, N] (f32, f16 or bf16) -> f32 [rows, N]. `splits` overrides the
    plan's K split (tests reach every split count with it; results stay row-invariant for any).
    `ws`: the workspace the split partials and tickets come from (dspark.ops.workspace)."""
    x, w, out = adopt(be, x=x, w=w, out=out, writes=("out",))
    require_ndim(x, 2, "x", "[rows, K]")
    require_dtype(x, F32, "x")
    require_ndim(w, 2, "w", "[K, N]")
    suf = suffix(w.dtype, "w")
    rows, k = x.shape
    if w.shape[0] != k:
        raise ShapeError(f"w has shape {tuple(w.shape)}: expected ({k}, N) for x of shape {tuple(x.shape)}")
    n = w.shape[1]
    if out is not None:
        require_shape(out, (rows, n), "out")
        require_dtype(out, F32, "out")
    if be.kernels is None:
        return product.host_linear(x, w, out)
    xp = be.xp
    x, w = xp.ascontiguousarray(x), xp.ascontiguousarray(w)
    if out is None:
        out = xp.empty((rows, n), F32)
    if rows and n:
        s, kchunk = split_plan(k, n) if splits is None else chunking(k, splits)
        t = tiles(n, w.dtype.itemsize)
        part = buffer(be, ws, f"linear.part.{s * n}", rows, (s * n,)) if s > 1 else fixed(be, ws, "linear.part", (1,))
        tickets, _ = rowsplit.scratch(be, t, ws=ws)
        rowsplit.launch(be, f"linear_{suf}", t * s, THREADS,
                        (x, w, np.int32(rows), np.int32(k), np.int32(n), np.int32(kchunk), np.int32(s), out, part,
                         tickets))
    return out


# ---- launch plan ------------------------------------------------------------------------------------
def linear_plan(rows: int, k: int, n: int, itemsize: int) -> Plan:
    """linear_<dt> over x [rows, K] and w [K, N] of `itemsize`-byte entries: one launch of
    tiles * splits CTAs. Each CTA reads its [kchunk, columns] block of w once per ROW_TILE rows and
    the matching x; with splits > 1 every CTA writes its partials and the last of a tile reads them
    all back. `vocab` holds N."""
    s, kchunk = split_plan(k, n)
    t = tiles(n, itemsize)
    passes = -(-max(rows, 1) // ROW_TILE)
    w_bytes, x_bytes, out_bytes = k * n * itemsize, rows * k * 4, rows * n * 4
    part = s * rows * n * 4 if s > 1 else 0
    smem = 4 * WARPS * SMEM_ROWS * cols_per_cta(itemsize)  # the warps' sums, static
    return Plan("linear", rows, n, s, (Launch("linear", t * s, THREADS, smem, passes=passes),),
                bytes_read=passes * w_bytes + t * x_bytes + part, bytes_written=out_bytes + part,
                min_bytes=w_bytes + x_bytes + out_bytes,
                notes={"flops": 2 * rows * k * n, "tiles": t, "kchunk": kchunk})
