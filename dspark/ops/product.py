"""The numpy backend's product, out f32 [rows, N] = x f32 [rows, K] @ w [K, N], in native code
(dspark._cpu, csrc/cpu/product.h), with `product_ref` its NumPy twin bit for bit.

Row invariance (DESIGN section 3) without padding: every output is summed in one order fixed by K
alone, acc = 0, then acc = acc + x[r, k] * w[k, n] for k = 0 .. K - 1, each multiply and each add
rounded to f32 (no contracted multiply-add). No number of rows, no column split and no vector
width changes that order, so a row alone, the same row among 300, a prefill row and the decode
step at its position are bitwise equal, with any thread count and on any instruction set the
module was built for (AVX-512, AVX2, the baseline: `dspark._cpu.isas`). w is read as stored (f32,
f16, bf16) and widened exactly, from memory once per strip of columns; the columns are split
across `get_num_threads()` threads. FP8 weights (`product_fp8`: e4m3 bytes, one scale per 128 x 128
block) are read as bytes and dequantized block by block into the panels the tiles read, W =
fl32(e4m3(q) * scale) (dspark.ops.fp8): bitwise the f32 product of W.
"""

from __future__ import annotations

import os

import numpy as np

from ..dtypes import BF16
from ..errors import BackendUnavailable
from .dense import widen
from .fp8 import dequantize

F32 = np.float32
DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, BF16: 2}
WORK_PER_THREAD = 1 << 21   # K N (rows + 4) (reading a weight costs about four rows): less runs on one thread
PANEL = 48  # columns of a Panelled weight's panel: csrc/cpu/product.h's kLayoutPanel

_threads: int | None = None


def default_threads() -> int:
    """DSPARK_NUM_THREADS, else the cores this process may run on."""
    env = os.environ.get("DSPARK_NUM_THREADS")
    if env:
        return _check_threads(int(env) if env.strip().isdigit() else env, "DSPARK_NUM_THREADS")
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _check_threads(n, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{what}={n!r}: expected an int >= 1")
    return int(n)


def set_num_threads(n: int) -> None:
    """Threads for the numpy backend's native code (its product splits N across them). Results do
    not depend on it."""
    global _threads
    _threads = _check_threads(n, "threads")


def get_num_threads() -> int:
    global _threads
    if _threads is None:
        _threads = default_threads()
    return _threads


try:
    from .. import _cpu
except ImportError:  # a tree without the build (a GPU machine with no host compiler): the NumPy twins run
    _cpu = None

NATIVE = _cpu is not None


def _module():
    if _cpu is None:
        raise BackendUnavailable("dspark._cpu is not built (pip install -e . builds it): the numpy backend runs its "
                                 "NumPy twins instead")
    return _cpu


def native_status() -> str:
    """What the numpy backend runs: the native module's instruction set and threads, or the twins."""
    if not NATIVE:
        return "numpy backend: NumPy twins of the native code (dspark._cpu is not built), the same bits"
    return f"numpy backend: native code {_cpu.isa()} (of {', '.join(_cpu.isas)}), {get_num_threads()} thread(s)"


# ---- NumPy ------------------------------------------------------------------------------------------
def product_ref(x, w) -> np.ndarray:
    """The native product's arithmetic in NumPy, bitwise: one elementwise multiply and add per k."""
    x = np.asarray(x, F32)
    wf = np.asarray(widen(np.asarray(w)), F32)
    acc = np.zeros((x.shape[0], wf.shape[1]), F32)
    for k in range(x.shape[1]):
        acc = acc + x[:, k : k + 1] * wf[k]
    return acc


# ---- native -----------------------------------------------------------------------------------------
def blocking(rows: int, transposed: bool = False) -> tuple[int, int]:
    """(strip, kblock) for a product of `rows` rows (csrc/cpu/product.h): the columns a thread
    walks at once and the rows of w per block of the tiles. Neither changes a single bit of the
    result."""
    if rows > 2 or transposed:  # tiles: a block of w (252 KB in f32) in L2 beside the next one, the
        return 1008, 64            # strip whole panels (21 of AVX-512's 48 columns, 42 AVX2, 84 baseline)
    return 8192, 1  # streamed: long runs of each row of w, accumulators in L1 / L2


class Panelled:
    """A weight w [K, N] laid out for the product: its columns in panels of PANEL, each panel's
    [K, PANEL] block contiguous (`panels` [P, K, PANEL], zero past N), so that the tiles walk K
    from one run of memory instead of PANEL columns every N. The loader lays out the numpy
    backend's matrices so (dspark.models.weights); it replaces the row-major array (one copy, K
    (P PANEL - N) padding entries more). The product's bits are those of the row-major w. NumPy
    sees the row-major matrix (np.asarray(w), a copy); `linear` takes it as it is."""

    ndim = 2

    def __init__(self, w):
        w = np.asarray(w)
        if w.ndim != 2:
            raise ValueError(f"w has shape {w.shape}: expected [K, N]")
        k, n = w.shape
        self.panels = np.zeros((-(-n // PANEL), k, PANEL), w.dtype)  # w and this at once while loading, no more
        for i, at in enumerate(range(0, n, PANEL)):
            part = w[:, at : at + PANEL]
            self.panels[i, :, : part.shape[1]] = part
        self.shape, self.dtype = (k, n), w.dtype

    @property
    def nbytes(self) -> int:
        return int(self.panels.nbytes)

    def __array__(self, dtype=None, copy=None):
        k, n = self.shape
        w = self.panels.transpose(1, 0, 2).reshape(k, -1)[:, :n]
        return np.ascontiguousarray(w if dtype is None else w.astype(dtype))


class PanelledColumns:
    """Columns [at, at + width) of a Panelled matrix (a fused matrix's part): its shape and dtype,
    and the row-major columns for NumPy (np.asarray, a copy). The trunk multiplies by the whole."""

    ndim = 2

    def __init__(self, whole: Panelled, at: int, width: int):
        self.whole, self.at = whole, at
        self.shape, self.dtype = (whole.shape[0], width), whole.dtype

    def __array__(self, dtype=None, copy=None):
        k, width = self.shape
        first, last = self.at // PANEL, -(-(self.at + width) // PANEL)  # only the panels it spans
        w = self.whole.panels[first:last].transpose(1, 0, 2).reshape(k, -1)
        w = w[:, self.at - first * PANEL : self.at - first * PANEL + width]
        return np.ascontiguousarray(w if dtype is None else w.astype(dtype))


def _result(rows: int, k: int, n: int, out):
    """(out, made if None; whether it already is the answer: no rows, no columns, or K = 0)."""
    if out is None:
        out = np.empty((rows, n), F32)
    if rows == 0 or n == 0:
        return out, True
    if k == 0:
        out[...] = 0
        return out, True
    return out, False


def _native_threads(rows: int, k: int, n: int, threads: int | None, isa: str) -> int:
    """The threads a native product runs on (default: get_num_threads(), fewer for a small one),
    after checking `isa`."""
    if isa and isa not in _cpu.isas:
        raise BackendUnavailable(f"isa={isa!r}: expected one this CPU runs, {', '.join(_cpu.isas)}")
    if threads is None:  # a small product is not worth waking a thread for
        threads = max(1, min(get_num_threads(), k * n * (rows + 4) // WORK_PER_THREAD))
    return threads


def product(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None, *, threads: int | None = None,
            isa: str = "") -> np.ndarray:
    """x f32 [rows, K] @ w [K, N] (f32, f16 or bf16) -> out f32 [rows, N]: x and out C-contiguous
    host arrays, w C-contiguous or the transpose of a C-contiguous [N, K] (a tied LM head, read in
    place). The op validates; this only computes. `threads` (default: get_num_threads(), fewer for
    a small product) and `isa` (one of dspark._cpu.isas: "avx512", "avx2", "base"; default: the
    best this CPU runs) are for tests and benchmarks."""
    rows, k = x.shape
    n = w.shape[1]
    out, done = _result(rows, k, n, out)
    if done:
        return out
    panelled = isinstance(w, Panelled)
    transposed = not panelled and not w.flags.c_contiguous
    if transposed and not w.T.flags.c_contiguous:
        w, transposed = np.ascontiguousarray(w), False
    if not NATIVE:  # its twin: the same bits, slower
        out[...] = product_ref(x, w)
        return out
    threads = _native_threads(rows, k, n, threads, isa)
    strip, kblock = blocking(rows, transposed)
    stored, layout = (w.panels, 2) if panelled else (w.T, 1) if transposed else (w, 0)
    _module().product(DTYPE_CODES[w.dtype], x, stored, layout, out, rows, k, n, threads, strip, kblock, isa)
    return out


def product_fp8(x: np.ndarray, q: np.ndarray, scale: np.ndarray, out: np.ndarray | None = None, *,
                threads: int | None = None, isa: str = "") -> np.ndarray:
    """x f32 [rows, K] @ W -> out f32 [rows, N], W = e4m3(q) * scale (q uint8 [K, N], scale f32
    [ceil(K / 128), ceil(N / 128)], all C-contiguous host arrays the op validated). Always the
    tiled walk (blocking's kblock 64): the bytes are dequantized into its panels whatever the rows."""
    rows, k = x.shape
    n = q.shape[1]
    out, done = _result(rows, k, n, out)
    if done:
        return out
    if not NATIVE:
        out[...] = product_ref(x, dequantize(q, scale))
        return out
    threads = _native_threads(rows, k, n, threads, isa)
    strip, kblock = blocking(rows, transposed=True)
    _module().product_fp8(x, q, scale, out, rows, k, n, threads, strip, kblock, isa)
    return out


def host_linear_fp8(x, q, scale, out=None) -> np.ndarray:
    """The numpy backend's `linear` of an FP8 matrix (validated there)."""
    x, q, scale = np.ascontiguousarray(x), np.ascontiguousarray(q), np.ascontiguousarray(scale)
    if out is not None and out.flags.c_contiguous:
        return product_fp8(x, q, scale, out)
    y = product_fp8(x, q, scale)
    if out is None:
        return y
    out[...] = y
    return out


def host_linear(x, w, out=None) -> np.ndarray:
    """The numpy backend's `linear` (validated there): x of any strides, w as product() takes it
    (else copied), written into `out` if given."""
    x = np.ascontiguousarray(x)
    if out is not None and out.flags.c_contiguous:
        return product(x, w, out)
    y = product(x, w)
    if out is None:
        return y
    out[...] = y
    return out
