"""The model's GEMM, out f32 [rows, N] = x f32 [rows, K] @ w [K, N] (kernels: csrc/linear.cu,
csrc/linear_mma.cuh).

Weights stay as stored (f32, f16 or bf16). Row invariance (DESIGN section 3) needs each output's
summation order to be a function of the shapes alone, never of `rows`:

* f32 weights on simt and cuda run `linear_f32` (CUDA cores, f32 multiplies and adds): column
  tiles of 32 16-byte vectors per CTA, K cut into `splits` chunks of `kchunk` rows (`split_plan`:
  from K and N alone, enough CTAs to fill an H200 at one row), 4 warps per chunk; the last CTA of
  a tile adds the chunks' partials in index order. It reads each weight once per 16 rows
  (ROW_TILE). `linear_ref` is its NumPy twin, bit for bit (the kernel tests compare them with
  array_equal).
* 16-bit weights on simt and cuda run the tensor-core GEMM `linear_mma_<dt>_m<BM>`: the
  activations rounded to the weight's type (round to nearest even, as bf16 engines do), mma.sync
  m16n8k16 with f32 accumulation in k-steps of 16, K cut into chunks of `kchunk` (a multiple of 32,
  `mma_split_plan`: from K and N alone) whose partials are added in index order. Row tiles of 16,
  32, 64 or 128 rows (`mma_plan`: by the row count, which also picks whether a tile's chunks run in
  one CTA or in one CTA each) read each weight once per tile; the order is the same for every tile
  shape and mode. `linear_mma_ref` is its NumPy twin: bit for bit with simt's emulated MMA
  (csrc/simt/tensor_core.h: exact products summed in double in increasing k, one rounding), and
  within the MMA bound of a GPU's. This path does not give the product of the f32 widening: a
  16-bit weight and its f32 copy give different bits (the f32 copy takes the f32 kernel).
* numpy (the reference backend) runs dspark.ops.product for every weight dtype: native code
  (dspark._cpu) summing each output in k order over the weights read as stored and widened
  exactly, the activations kept f32; its NumPy twin `product_ref` bit for bit, no padding. So on
  numpy a 16-bit weight gives bitwise the product of its f32 widening, and numpy's 16-bit products
  differ from simt's and cuda's by the activations' rounding (MMA_TOLERANCE); `linear_mma_ref`,
  not the numpy backend, is the oracle of the 16-bit kernels.
* `linear_numpy` is the product in fixed-shape BLAS chunks of ROW_CHUNK rows, zero-padded (BLAS
  picks its algorithm, and so its order, by shape: a plain `x @ w` over a batch is not
  row-invariant, a fixed [ROW_CHUNK, K] x [K, N] product is): the yardstick the tests hold the
  f32 orders to. Any two f32 orders agree within f32 rounding: |a - b| <= 1e-5 * (|x| @ |w|) for K
  up to a few thousand (TOLERANCE).

* FP8 weights (dspark.ops.fp8.Fp8Matrix: e4m3 bytes and one scale per 128 x 128 block) run the
  same tensor-core GEMM with the weights dequantized in registers, `linear_fp8_<dt>_m<BM>`
  (csrc/linear_fp8.cu): bitwise `linear_mma_ref` over fp8.dequantize(q, scale, dt), dt the
  matrix's `compute` type, its K chunk a multiple of the scale block (`fp8_plan`). On numpy the
  native product reads the bytes too (dspark.ops.product.product_fp8): bitwise `product_ref` over
  the f32 dequantization.
* A fused matrix whose parts cannot be one matrix (FP8 parts beside 16-bit ones, or an FP8 part
  that ends inside a column block) is a `ColumnRuns`: each run's product into its columns.

`linear_plan` gives the kernel's launch and bytes for given shapes without running anything.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..arrays import adopt
from ..dtypes import BF16, suffix
from ..errors import DTypeError, ShapeError
from . import product, rowsplit
from .fp8 import BLOCK as FP8_BLOCK, Fp8Matrix, dequantize, scale_grid
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
# The tensor-core GEMM (csrc/linear_mma.cuh): BM -> (BN, BK, warps, stages), MmaGemmM<BM> there.
MMA_CONFIGS = {16: (256, 32, 4, 4), 32: (256, 32, 4, 4), 64: (128, 32, 8, 4), 128: (128, 32, 8, 4)}
# The wide prompt tile (MmaGemmM128N256: the K chunks' running total in shared memory, not beside the
# accumulators, so a warp holds 64 x 64 outputs): BM -> (BN, BK, warps, stages), the entry ..._m128n256.
MMA_WIDE = {128: (256, 32, 8, 3)}
# The FP8 GEMM (csrc/linear_fp8.cu): the decode shapes (BM 16 and 32, Fp8StreamM16 / M32 there: the bytes
# straight into the MMA's B fragments, split mode only; BK here is a main-loop trip, two iterations of an A
# stage of FP8_STREAM_STAGE_K columns, two buffers), then linear_mma's.
FP8_STREAM = {16: (256, 128, 4, 2), 32: (256, 128, 8, 2)}
FP8_STREAM_STAGE_K = 64
FP8_CONFIGS = {**MMA_CONFIGS, **FP8_STREAM}
MMA_STEP = 16          # k per mma.sync m16n8k16: the order's k-step
MMA_ALIGN = 32         # kchunk is a multiple of it, so every tile shape's BK divides a chunk
FP8_ALIGN = FP8_BLOCK  # FP8 weights: kchunk a multiple of the 128-row scale block
MMA_SPLIT_TILE = 256   # the column tile the K split aims at (the BM 16 and 32 shapes': few rows)
MMA_GROUP_ROWS = 8     # kMmaGroupRows: fold mode's CTAs take their tiles in groups of this many row tiles
MMA_TARGET_CTAS = 264  # two per SM of an H200: the most CTAs the K split aims at for one row tile
SMS = 132              # an H200's SMs: the split prefers CTA counts that fill whole waves of them
# linear_numpy (f32 product of the widened weights) vs the 16-bit kernels: the activations'
# rounding to bf16 (8 significant bits: relative 2^-9) dominates, relative to |x| @ |w|.
# linear.cu's tile shapes with a fused activation stage (linear_mma_<dt>_swiglu_<shape>, _gated_<shape>):
# all but the wide prompt tile
STAGE_SHAPES = ("m16", "m32", "m64", "m128")
MMA_TOLERANCE = {np.dtype(np.float16): 2.0**-11 + 1e-5, BF16: 2.0**-8 + 1e-5}


def cols_per_cta(itemsize: int) -> int:
    """Columns of a CTA tile: one 16-byte vector per lane of a warp."""
    return 32 * (16 // itemsize)


def tiles(n: int, itemsize: int) -> int:
    """Column tiles of w [K, N] with `itemsize`-byte entries: one CTA column each."""
    return max(1, -(-n // cols_per_cta(itemsize)))


def split_plan(k: int, n: int) -> tuple[int, int]:
    """(splits, kchunk) of the f32 kernel over w [K, N]: enough K splits that the 16-bit-wide
    column tiles of N times the splits reach TARGET_CTAS, each at least MIN_CHUNK rows of w;
    kchunk = ceil(K / splits). A function of (K, N) alone, never of the rows. (16-bit weights take
    the tensor-core GEMM and its own split, `mma_split_plan`.)"""
    want = -(-TARGET_CTAS // tiles(n, 2))
    return chunking(k, max(1, min(want, k // MIN_CHUNK)))


def chunking(k: int, splits: int) -> tuple[int, int]:
    """(splits, kchunk) for K cut into about `splits` equal chunks: kchunk = ceil(K / splits) >= 1,
    splits recounted so that none is empty."""
    kchunk = max(1, -(-k // max(1, splits)))
    return max(1, -(-k // kchunk)), kchunk


@dataclass(frozen=True)
class MmaPlan:
    """One launch of the tensor-core GEMM: BM-row tiles (`bm`, the entry linear_mma_<dt>_m<bm>),
    BN-column tiles, the K its main loop takes per iteration (`bk`), the K split (`splits` chunks of
    `kchunk`) and how many CTAs share a tile's chunks (`grid_splits`: 1 folds them in one CTA,
    `splits` gives each chunk its CTA)."""
    bm: int
    bn: int
    bk: int
    threads: int
    shared_mem: int
    m_tiles: int
    n_tiles: int
    splits: int
    kchunk: int
    grid_splits: int

    @property
    def shape(self) -> str:
        """The entry's tile suffix: m<bm>, or m<bm>n<bn> for the one-chunk prompt tile (MMA_WIDE)."""
        return f"m{self.bm}n{self.bn}" if self.bm in MMA_WIDE and self.bn == MMA_WIDE[self.bm][0] else f"m{self.bm}"

    @property
    def grid(self) -> tuple[int, int]:
        return self.n_tiles * self.grid_splits, self.m_tiles

    @property
    def ctas(self) -> int:
        return self.m_tiles * self.n_tiles * self.grid_splits


def mma_shared_mem(bm: int, configs: dict = MMA_CONFIGS) -> int:
    """Dynamic shared memory of linear_mma's BM-row shape: STAGES buffers of A [BM][BK + 8] and
    B [BK][BN + 8], 16-bit, and for the wide tile the running total, f32 [BM][BN]
    (MmaGemmConfig::SMEM_BYTES)."""
    bn, bk, _, stages = configs[bm]
    return 2 * stages * (bm * (bk + 8) + bk * (bn + 8)) + (4 * bm * bn if configs is MMA_WIDE else 0)


def fp8_shared_mem(bm: int) -> int:
    """Dynamic shared memory of linear_fp8's BM-row shape: the decode shapes' A stages alone
    (Fp8StreamConfig::SMEM_BYTES: no weight touches shared memory), else linear_mma's."""
    if bm not in FP8_STREAM:
        return mma_shared_mem(bm)
    stages = FP8_STREAM[bm][3]
    return 2 * stages * bm * (FP8_STREAM_STAGE_K + 8)


def wave_fill(ctas: int) -> float:
    """How fully `ctas` CTAs fill whole waves of SMS SMs, one CTA an SM a wave: 1.0 when every SM
    holds as many as every other."""
    return ctas / (SMS * -(-ctas // SMS))


@functools.lru_cache(maxsize=None)   # a search over up to `tiles` counts: once per shape, not per launch
def whole_wave_tiles(tiles: int, grid_splits: int) -> int:
    """Column tiles for a launch of one 16-row tile (csrc/linear_mma.cuh's mma_tile_column deals N's
    groups of 8 columns over them): from `tiles` (ceil(N / BN)) up to twice as many, each at least half
    a tile wide, the count whose CTAs (tiles x grid_splits) fill the SMs' whole waves best (wave_fill),
    the fewest on a tie. Columns never share a sum, so the count moves no bit; the K split, which
    does, stays mma_split_plan's."""
    return max(range(tiles, 2 * tiles + 1), key=lambda t: (wave_fill(t * grid_splits), -t))


def mma_split_plan(k: int, n: int, align: int = MMA_ALIGN) -> tuple[int, int]:
    """(splits, kchunk) of the tensor-core GEMM over w [K, N]. The column tiles of few rows
    (MMA_SPLIT_TILE) times the chunks stay within MMA_TARGET_CTAS (one row tile streams the
    weights from about two CTAs per SM), each chunk at least MIN_CHUNK rows of w, kchunk a multiple
    of `align` (MMA_ALIGN; FP8_ALIGN for FP8 weights); among those counts, the one whose CTAs fill
    the SMs' last wave best (the most chunks on a tie). A function of (K, N) alone: the order of
    every output, whatever the rows, tile shape or mode."""
    tiles_n = max(1, -(-n // MMA_SPLIT_TILE))
    best = (0.0, 1, max(align, -(-k // align) * align))
    for want in range(1, max(1, min(MMA_TARGET_CTAS // tiles_n, k // MIN_CHUNK)) + 1):
        kchunk = max(align, -(-(-(-k // want)) // align) * align)
        splits = max(1, -(-k // kchunk))
        best = max(best, (wave_fill(tiles_n * splits), splits, kchunk))
    return best[1], best[2]


# Dynamic shared memory one CTA may take, by compute capability (CUDA programming guide: 227 KB on sm_90,
# 163 KB on sm_80, 99 KB on sm_86 / sm_89); the model's H200 and simt take sm_90's.
SHARED_LIMIT = {90: 232448, 80: 166912, 86: 101376, 87: 166912, 89: 101376}


def shared_limit(be) -> int:
    """The dynamic shared memory a CTA may take on the backend's device (SHARED_LIMIT; 48 KB for an
    architecture not listed); simt's is sm_90's, so its plans are an H200's."""
    arch = getattr(be.kernels, "arch", None)
    return SHARED_LIMIT[90] if arch is None else SHARED_LIMIT.get(int(arch.split("_")[1]), 49152)


def mma_plan(rows: int, k: int, n: int, *, bm: int | None = None, split: bool | None = None,
             wide: bool | None = None, align: int = MMA_ALIGN, configs: dict = MMA_CONFIGS,
             shared_mem=mma_shared_mem, wide_configs: dict = MMA_WIDE, limit: int = SHARED_LIMIT[90],
             whole_waves: bool = True) -> MmaPlan:
    """The tensor-core GEMM's launch for x [rows, K] @ w [K, N]: the smallest row tile that holds
    the rows (at most 128); a tile's chunks in one CTA each while the tiles alone would leave an
    H200 short of TARGET_CTAS, else folded in one CTA; a prompt's tile twice as wide (`wide_configs`:
    half the activations' re-reads through L2 per flop) where the device's shared memory per CTA
    (`limit`, shared_limit) holds it; a launch of one 16-row tile (decode and verify of one or two
    sessions) in as many column tiles as fill the SMs' whole waves (whole_wave_tiles; a 32-row tile
    reads twice the activations a column tile, and more tiles would make it bound by those re-reads
    through L2; `whole_waves` False keeps ceil(N / BN): linear_fp8's decode shapes place their columns
    by BN). `bm`, `split` and
    `wide` force a shape or mode (tests); the bits never depend on them. `align`: the K chunk's
    (mma_split_plan); `configs` and `shared_mem`: the kernel's tile shapes (linear_mma's, or
    linear_fp8's: fp8_plan, which has no wide tile)."""
    splits, kchunk = mma_split_plan(k, n, align)
    if bm is None:
        bm = next((b for b in sorted(configs) if rows <= b), max(configs))
    if bm not in configs:
        raise ValueError(f"bm={bm!r}: expected one of {tuple(configs)}")
    m_tiles = max(1, -(-rows // bm))
    if split is None:
        split = splits > 1 and m_tiles * max(1, -(-n // configs[bm][0])) < MMA_TARGET_CTAS
    if wide is None:
        wide = (bm in wide_configs and not (split and splits > 1) and m_tiles > 1
                and mma_shared_mem(bm, wide_configs) <= limit)
    if wide and (bm not in wide_configs or split and splits > 1):
        raise ValueError(f"wide=True with bm={bm}, split={split}: the wide tile is a prompt's (fold mode), "
                         f"BM in {tuple(wide_configs)}")
    tiles = wide_configs if wide else configs
    bn, bk, warps, _ = tiles[bm]
    grid_splits = splits if split else 1
    n_tiles = max(1, -(-n // bn))
    if whole_waves and m_tiles == 1 and bm == 16:
        n_tiles = whole_wave_tiles(n_tiles, grid_splits)
    return MmaPlan(bm, bn, bk, 32 * warps, mma_shared_mem(bm, tiles) if wide else shared_mem(bm), m_tiles,
                   n_tiles, splits, kchunk, grid_splits)


def fp8_plan(rows: int, k: int, n: int, *, bm: int | None = None, split: bool | None = None) -> MmaPlan:
    """The FP8 GEMM's launch (linear_fp8_<dt>_m<bm>): mma_plan's modes, the K chunk a multiple of the
    128-row scale block, from (K, N) alone. The decode shapes (FP8_STREAM) run split mode only: a
    chunk per CTA (a fold of a few rows' partials costs little), so `split=False` is refused there."""
    if bm is None:
        bm = next((b for b in sorted(FP8_CONFIGS) if rows <= b), max(FP8_CONFIGS))
    if bm in FP8_STREAM:
        if split is False:
            raise ValueError(f"split=False with bm={bm}: linear_fp8's decode shapes run split mode only")
        split = True
    return mma_plan(rows, k, n, bm=bm, split=split, align=FP8_ALIGN, configs=FP8_CONFIGS, shared_mem=fp8_shared_mem,
                    wide_configs={}, whole_waves=False)


# ---- NumPy ------------------------------------------------------------------------------------------
def linear_fp8_ref(x, q, scale, dtype, kchunk: int) -> np.ndarray:
    """The FP8 GEMM's arithmetic on host arrays, bitwise: linear_mma_ref over W =
    fp8.dequantize(q, scale, dtype) (csrc/linear_fp8.cu's header)."""
    return linear_mma_ref(x, dequantize(q, scale, dtype), kchunk)


def linear_mma_ref(x, w, kchunk: int) -> np.ndarray:
    """The tensor-core GEMM's arithmetic on host arrays (csrc/linear_mma.cuh's header), bitwise
    with simt's emulated MMA: x rounded to w's 16-bit type; per chunk of `kchunk` rows of w, k-steps
    of MMA_STEP each summing the accumulator and its exact products in double in increasing k and
    rounding once to f32; the chunks' partials added in index order from -0."""
    w = np.asarray(w)
    if w.dtype not in (np.dtype(np.float16), BF16):
        raise DTypeError(f"w has dtype {w.dtype}: expected float16 or bfloat16 (the tensor-core GEMM)")
    a = np.asarray(x, F32).astype(w.dtype).astype(np.float64)
    wf = np.asarray(widen(w), np.float64)
    rows, k = a.shape
    total = np.full((rows, wf.shape[1]), -0.0, F32)
    for lo in range(0, k, kchunk):
        hi = min(k, lo + kchunk)
        part = np.zeros_like(total)
        for s0 in range(lo, hi, MMA_STEP):
            acc = part.astype(np.float64)
            for kk in range(s0, min(hi, s0 + MMA_STEP)):  # padding adds +0: no change (acc is never -0)
                acc = acc + a[:, kk : kk + 1] * wf[kk]
            part = acc.astype(F32)
        total = total + part
    return total


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
def linear(be, x, w, out=None, *, splits: int | None = None, bm: int | None = None, split: bool | None = None,
           wide: bool | None = None, ws=None):
    """x [rows, K] f32 @ w [K, N] (f32, f16 or bf16) -> f32 [rows, N]. `splits` overrides the f32
    kernel's K split (tests reach every split count with it; results stay row-invariant for any);
    `bm`, `split` and `wide` force the tensor-core GEMM's tile shape and mode (mma_plan; the bits
    never depend on them). `ws`: the workspace the split partials and tickets come from
    (dspark.ops.workspace)."""
    if isinstance(w, ColumnRuns):
        return w.linear(be, x, out, ws)
    if isinstance(w, Fp8Matrix):
        return linear_fp8(be, x, w, out, bm=bm, split=split, ws=ws)
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
    if w.dtype != F32:
        _require_tensor_cores(be)
        if rows and n:
            p = mma_plan(rows, k, n, bm=bm, split=split, wide=wide, limit=shared_limit(be))
            if a16(p, k):   # a prompt: the activations rounded once into T, copied into the tiles as T
                xh = buffer(be, ws, f"linear.x16.{suf}.{k}", rows, (k,), w.dtype)
                round_activations(be, x, xh)
                launch_mma(be, f"linear_mma_{suf}_a16", p, xh, (w,), out, ws)
            else:
                launch_mma(be, f"linear_mma_{suf}", p, x, (w,), out, ws)
        return out
    if rows and n:
        s, kchunk = split_plan(k, n) if splits is None else chunking(k, splits)
        t = tiles(n, w.dtype.itemsize)
        part = buffer(be, ws, f"linear.part.{s * n}", rows, (s * n,)) if s > 1 else fixed(be, ws, "linear.part", (1,))
        tickets, _ = rowsplit.scratch(be, t, ws=ws)
        rowsplit.launch(be, f"linear_{suf}", t * s, THREADS,
                        (x, w, np.int32(rows), np.int32(k), np.int32(n), np.int32(kchunk), np.int32(s), out, part,
                         tickets))
    return out


def linear_fp8(be, x, w: Fp8Matrix, out=None, *, bm: int | None = None, split: bool | None = None, ws=None):
    """x [rows, K] f32 @ the FP8 matrix w [K, N] -> f32 [rows, N] (module doc; `linear`'s arguments)."""
    x, q, scale, out = adopt(be, x=x, q=w.q, scale=w.scale, out=out, writes=("out",))
    require_ndim(x, 2, "x", "[rows, K]")
    require_dtype(x, F32, "x")
    rows, k = x.shape
    if q.ndim != 2 or q.shape[0] != k:
        raise ShapeError(f"w has shape {tuple(q.shape)}: expected ({k}, N) for x of shape {tuple(x.shape)}")
    n = q.shape[1]
    require_dtype(q, np.uint8, "w.q")
    require_dtype(scale, F32, "w.scale")
    require_shape(scale, scale_grid(k, n), "w.scale")
    if out is not None:
        require_shape(out, (rows, n), "out")
        require_dtype(out, F32, "out")
    if be.kernels is None:
        return product.host_linear_fp8(x, q, scale, out)
    suf = suffix(w.compute, "w.compute")
    if suf == "f32":
        raise DTypeError("w.compute is float32: FP8 weights multiply on tensor cores with 16-bit activations on the "
                         "kernel backends (W8A16): expected bfloat16 or float16")
    _require_tensor_cores(be)
    xp = be.xp
    x, q, scale = xp.ascontiguousarray(x), xp.ascontiguousarray(q), xp.ascontiguousarray(scale)
    if out is None:
        out = xp.empty((rows, n), F32)
    if rows and n:
        launch_mma(be, f"linear_fp8_{suf}", fp8_plan(rows, k, n, bm=bm, split=split), x, (q, scale), out, ws)
    return out


ROUND_THREADS = 256   # round_activations: four activations a thread


def a16(p: MmaPlan, k: int) -> bool:
    """Whether a 16-bit product runs over activations rounded to the weights' type first
    (`round_activations`, then linear_mma_<dt>_a16_<shape>): a prompt's fold-mode tiles (64 or 128
    rows), which read each row of x once per column tile, so that half the bytes pass through L2;
    K % 8 == 0 (16-byte copies). The bits are the f32 path's: the tiles hold the same values."""
    return p.grid_splits == 1 and p.m_tiles > 1 and p.bm >= 64 and k % 8 == 0


def round_activations(be, x, out) -> None:
    """out (the weights' 16-bit type) = x f32 rounded as the GEMM's A stage rounds it, one launch
    (round_activations_<dt>); x and out contiguous, their size a multiple of 4."""
    n = int(x.size)
    rowsplit.launch(be, f"round_activations_{suffix(out.dtype, 'out')}", -(-n // (4 * ROUND_THREADS)), ROUND_THREADS,
                    (x, np.int64(n), out))


def launch_mma(be, entry: str, p: MmaPlan, x, weights: tuple, out, ws, k: int | None = None, extra: tuple = ()) -> None:
    """One launch of a tensor-core GEMM entry (`entry`_m<bm>: linear_mma's or linear_fp8's, which
    differ in their weight arguments alone) over x [rows, K] into out [rows, N] by plan p; `k`: the
    product's K where x is wider (the SwiGLU entries' gate|up, [rows, 2K]); `extra`: arguments after
    the common ones (the gated entries' gates)."""
    rows, n = x.shape[0], out.shape[1]
    k = x.shape[1] if k is None else k
    part = buffer(be, ws, f"linear.part.{p.splits * n}", rows, (p.splits * n,)) if p.grid_splits > 1 \
        else fixed(be, ws, "linear.part", (1,))
    tickets, _ = rowsplit.scratch(be, p.m_tiles * p.n_tiles, ws=ws)
    rowsplit.launch(be, f"{entry}_{p.shape}", p.grid, p.threads,
                    (x, *weights, np.int32(rows), np.int32(k), np.int32(n), np.int32(p.kchunk),
                     np.int32(p.grid_splits), out, part, tickets, *extra), shared_mem=p.shared_mem)


@dataclass(frozen=True)
class ColumnRuns:
    """A fused matrix [K, sum of widths] kept as runs of columns, each one matrix (an array,
    Panelled or Fp8Matrix): FP8 projections beside 16-bit ones (Qwen3.5's gdn input, whose a and b
    stay 16-bit), or an FP8 part ending inside a column block. Its product is each run's into its
    columns; a row's bits are each run's own, so row invariance is theirs."""
    runs: tuple  # ((matrix, first column), ...) in column order

    ndim = 2

    @property
    def shape(self) -> tuple[int, int]:
        return self.runs[0][0].shape[0], sum(m.shape[1] for m, _ in self.runs)

    def linear(self, be, x, out, ws):
        rows = x.shape[0]
        n = self.shape[1]
        if out is None:
            out = be.xp.empty((rows, n), F32)
        elif tuple(out.shape) != (rows, n):
            raise ShapeError(f"out has shape {tuple(out.shape)}: expected {(rows, n)}")
        for i, (m, at) in enumerate(self.runs):
            width = m.shape[1]
            part = linear(be, x, m, out=buffer(be, ws, f"linear.run.{i}.{width}", rows, (width,)), ws=ws)
            if be.kernels is None:
                out[:, at : at + width] = part
            elif rows and width:  # a launch, not an array op: a recorded round replays it
                rowsplit.launch(be, "linear_place_columns", -(-rows * width // 256), 256,
                                (part, np.int32(rows), np.int32(width), out, np.int32(n), np.int32(at)))
        return out


def tensor_cores(be) -> bool:
    """Whether a kernel backend runs 16-bit weights (the tensor-core GEMM): simt (which emulates
    them), and cuda on sm_80 or later."""
    arch = getattr(be.kernels, "arch", None)
    return arch is None or int(arch.split("_")[1]) >= 80


def _require_tensor_cores(be) -> None:
    if not tensor_cores(be):
        raise DTypeError(f"w: 16-bit weights need tensor cores (sm_80 or later); this device is "
                         f"{be.kernels.arch}: load the weights as float32")


# ---- launch plan ------------------------------------------------------------------------------------
def linear_plan(rows: int, k: int, n: int, itemsize: int) -> Plan:
    """The GEMM over x [rows, K] and w [K, N] of `itemsize`-byte entries. f32: linear_f32, one
    launch of tiles * splits CTAs; each CTA reads its [kchunk, columns] block of w once per
    ROW_TILE rows and the matching x; with splits > 1 every CTA writes its partials and the last of
    a tile reads them all back. 16-bit: mma_linear_plan; 1 (FP8): fp8_linear_plan. `vocab` holds N."""
    if itemsize == 2:
        return mma_linear_plan(rows, k, n)
    if itemsize == 1:
        return fp8_linear_plan(rows, k, n)
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


def mma_linear_plan(rows: int, k: int, n: int) -> Plan:
    """linear_mma over x [rows, K] and 16-bit w [K, N]: one launch of mma_plan's CTAs. Each row
    tile reads the weights once (`passes` = row tiles) and each column tile the rows' x; in split
    mode every CTA writes its chunk's partials and the last of a tile reads them all back.
    notes: flops (useful, 2 rows K N) and mma_flops (what the MMAs execute: whole 16 x 8 x 16
    steps over the padded tiles), the tile shape, mode and registers' home (threads)."""
    p = mma_plan(rows, k, n)
    w_bytes, x_bytes, out_bytes = 2 * k * n, 4 * rows * k, 4 * rows * n
    part = p.splits * rows * n * 4 if p.grid_splits > 1 else 0
    steps = sum(-(-(min(k, lo + p.kchunk) - lo) // MMA_STEP) for lo in range(0, k, p.kchunk))
    mma_flops = 2 * p.m_tiles * p.bm * (MMA_STEP * steps) * p.n_tiles * p.bn
    return Plan("linear_mma", rows, n, p.splits,
                (Launch(f"linear_mma_{p.shape}", p.ctas, p.threads, p.shared_mem, passes=p.m_tiles),),
                bytes_read=p.m_tiles * w_bytes + p.n_tiles * x_bytes + part, bytes_written=out_bytes + part,
                min_bytes=w_bytes + x_bytes + out_bytes,
                notes={"flops": 2 * rows * k * n, "mma_flops": mma_flops, "tiles": p.n_tiles, "kchunk": p.kchunk,
                       "bm": p.bm, "shape": p.shape, "grid_splits": p.grid_splits, "m_tiles": p.m_tiles})


def fp8_linear_plan(rows: int, k: int, n: int) -> Plan:
    """linear_fp8 over x [rows, K] and FP8 w [K, N]: one launch of fp8_plan's CTAs, the tile shapes
    and modes of mma_linear_plan. Each row tile reads the weights once at 1 byte each plus the
    scales (4 bytes per 128 x 128 block), and each column tile the rows' x; in split mode every CTA
    writes its chunk's partials and the last of a tile reads them back. notes: mma_linear_plan's,
    and w_bytes (one pass over the weights: q and the scales) and bytes_per_cta (what one CTA
    streams: its [K chunk, BN] tile of q, the scales it covers, its rows' x)."""
    p = fp8_plan(rows, k, n)
    kb, nb = scale_grid(k, n)
    w_bytes, x_bytes, out_bytes = k * n + 4 * kb * nb, 4 * rows * k, 4 * rows * n
    part = p.splits * rows * n * 4 if p.grid_splits > 1 else 0
    steps = sum(-(-(min(k, lo + p.kchunk) - lo) // MMA_STEP) for lo in range(0, k, p.kchunk))
    mma_flops = 2 * p.m_tiles * p.bm * (MMA_STEP * steps) * p.n_tiles * p.bn
    k_cta = p.kchunk if p.grid_splits > 1 else k
    cols = min(p.bn, n)
    per_cta = k_cta * cols + 4 * -(-k_cta // FP8_BLOCK) * -(-cols // FP8_BLOCK) + 4 * min(p.bm, rows) * k_cta
    return Plan("linear_fp8", rows, n, p.splits,
                (Launch(f"linear_fp8_{p.shape}", p.ctas, p.threads, p.shared_mem, passes=p.m_tiles),),
                bytes_read=p.m_tiles * w_bytes + p.n_tiles * x_bytes + part, bytes_written=out_bytes + part,
                min_bytes=w_bytes + x_bytes + out_bytes,
                notes={"flops": 2 * rows * k * n, "mma_flops": mma_flops, "tiles": p.n_tiles, "kchunk": p.kchunk,
                       "bm": p.bm, "shape": p.shape, "grid_splits": p.grid_splits, "m_tiles": p.m_tiles, "w_bytes": w_bytes,
                       "bytes_per_cta": per_cta})
