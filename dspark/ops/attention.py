"""Row-invariant GQA attention over per-session KV caches plus the block's own K/V, split across
CTAs at fixed absolute key positions (kernels: csrc/attention.cu).

Queries `q` [rows, Hq, D] are ragged over sessions by `row_indptr`; row i of session b sits at
absolute position pos[b] + i. Keys at positions p < pos[b] come from the session's cache
[Hkv, capacity, D] (slot p, or p % capacity for the drafter's ring), keys at p >= pos[b] from the
session's block rows in `k_blk` / `v_blk` [rows, Hkv, D]. Modes:

* ``causal`` (trunk prefill, decode, verify): row i sees [0, pos[b] + i], bottom-right aligned.
* ``block`` (drafter), ``window_mode="anchor"``: every row sees the window [max(0, pos[b] - window),
  pos[b]) of committed rows plus the whole block (speculators' anchor-relative window).
* ``block``, ``window_mode="row"``: row i (at p = pos[b] + i) sees the keys k with |p - k| < window,
  committed or in the block: the window measured from each row's own position, in both directions,
  as dflash.model._attention_mask masks a non-causal sliding layer (DFlash2 for Qwen3.8).

Row invariance (DESIGN section 3). The key axis is cut into splits at fixed absolute positions
(`SplitRule`: never a function of the launch, the batch or the row) and each split into tiles
[64t, 64t + 64). A row's result is its per-split partials (online softmax over the split's tiles,
p rounded to the storage dtype before p.v as the tensor cores take it), merged in increasing split
order, then normalised. Every step depends only on the row's own keys and positions: a verify
row is bitwise the decode step at its position, a session is bitwise the same alone or batched.

Launch plan (`launch_plan`, a pure function of the shapes). One CTA per (row chunk, kv head,
session) walks all the splits of its rows ("serial"), or one CTA per (row chunk, split, kv head,
session) writes split partials that a second kernel merges ("parallel", flash-decoding). Both
compute the same bits. The plan takes "parallel" when "serial" would leave an H200 mostly idle
(fewer CTAs than two per SM, as at one or two sessions with long contexts) and the partials stay
small; large batches walk serially. Prompt passes (causal, 16-bit K/V, a session of at least
PROMPT_MIN_ROWS rows) take "prompt": attention_prompt_<dt>_d<D>, the serial kernel's bits with
each warp owning 16 items for whole key tiles (flash-attention 2's split of the work), so q.k, the
softmax and p.v stay in registers; its CTAs hold PROMPT_ITEMS items (twice the serial kernel's rows
a K/V tile serves), which changes no bit: an item's sums do not depend on the CTA that holds it.

`attention_ref` is the NumPy twin: the same splits, tiles, rounding and merge, with shape-
independent reductions (elementwise products and pairwise halving sums, never matmul), so the numpy
backend is row-invariant too. Its sums halve pairwise where the kernel uses the MMA's order; the
two agree within the tolerance the tests state (1e-5 f32, 1e-2 f16/bf16, relative to 1 + |ref|).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ..arrays import adopt
from ..dtypes import BF16, suffix, to_f32
from ..errors import CapacityError, DTypeError, ShapeError
from . import host
from .checks import Staged, require_dtype, require_indptr, require_ndim, require_shape
from .kv_commit import require_kernel_buffers
from .linear import shared_limit
from .tables import PointerTable
from .workspace import buffer

TILE = 64                 # keys per tile; tiles sit at absolute positions
WARPS = 8                 # warps per CTA of the split kernels
COMBINE_THREADS = 64
HEAD_DIMS = (64, 128, 256)
MODES = ("causal", "block")
STRATEGIES = ("auto", "serial", "parallel", "prompt")
WINDOW_MODES = ("anchor", "row")   # block mode: the window from the anchor (all rows), or per row
# (m-tiles of 16 items, pipeline stages) per (storage bytes, head dim): the instantiations in
# csrc/attention.cu. f32 (CUDA cores) keeps 2 m-tiles; at D = 256 one stage (two do not fit).
CONFIGS = {(4, 64): (2, 2), (4, 128): (2, 2), (4, 256): (2, 1),
           (2, 64): (4, 2), (2, 128): (4, 2), (2, 256): (4, 2)}
# Where a device's shared memory per CTA (dspark.ops.linear.SHARED_LIMIT) does not hold CONFIGS' shape
# (D = 256 on an A100's 163 KB; D = 128 f32 and D = 256 on sm_86 / sm_89's 99 KB), the first of these
# that fits: fewer stages, fewer items, entries attention_<dt>_d<D>_m<MT>s<STAGES>. A CTA's items and its
# prefetch depth change no bit of an item's output.
SMALL_CONFIGS = {(4, 128): ((1, 1),), (4, 256): ((1, 1),), (2, 256): ((4, 1), (2, 1))}
PROMPT_THREADS = 256      # attention_prompt (kAttnPromptThreads): 8 warps of 16 items each
PROMPT_ITEMS = 128        # (row, head) items a prompt CTA holds: each K/V tile serves all of them
PROMPT_MIN_ROWS = 64      # rows of one session from which "auto" takes the prompt kernel
MAX_SHARED_MEM = 227 * 1024
SMS = 132                 # an H200: the plan fills it before it splits
PARTIAL_BUDGET = 64 << 20  # bytes of split partials the plan accepts before it walks splits serially
_REF_BUDGET = 1 << 22     # elements per NumPy temporary: bounds memory, changes no result


# ---- where the splits are ---------------------------------------------------------------------
@dataclass(frozen=True)
class SplitRule:
    """Split j covers absolute key positions [start(j), start(j + 1)), the same for every row and
    launch. Below 2 B (B = per_octave * min_keys) splits are min_keys long; each octave
    [2^k B, 2^(k+1) B) above is cut into per_octave splits of 2^k min_keys, until that reaches
    max_keys (a power-of-two multiple of min_keys): from there on every split is max_keys long.
    The default (256, 8, 1024) gives 16 splits at 4k keys, 48 at 32k and 144 at 128k: 196 CTAs
    at one 32k session with 4 kv heads, mostly of 1024 keys, whose partials cost about 7 % of
    the K/V bytes for a verify block of 8 rows x 6 heads. The kernels compute the same
    (AttnSplits, csrc/attention.cuh)."""
    min_keys: int = 256
    per_octave: int = 8
    max_keys: int = 1024

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

        if not is_int(self.min_keys) or self.min_keys < TILE or self.min_keys % TILE:
            raise ValueError(f"min_keys={self.min_keys!r}: expected a positive multiple of the tile ({TILE})")
        if not is_int(self.per_octave) or not 1 <= self.per_octave < 2**31 // self.min_keys:
            raise ValueError(f"per_octave={self.per_octave!r}: expected an int >= 1 with per_octave * min_keys < 2^31")
        ratio = self.max_keys // self.min_keys if is_int(self.max_keys) else 0
        if ratio < 1 or self.max_keys != self.min_keys * ratio or ratio & (ratio - 1) or self.max_keys >= 2**30:
            raise ValueError(f"max_keys={self.max_keys!r}: expected min_keys ({self.min_keys}) times a power of two")

    @classmethod
    def uniform(cls, keys: int) -> "SplitRule":
        """Splits of `keys` keys everywhere."""
        return cls(keys, 1, keys)

    @property
    def cap_octave(self) -> int:
        return (self.max_keys // self.min_keys).bit_length() - 1

    def index(self, p):
        """The split of absolute position(s) p."""
        p = np.asarray(p, np.int64)
        n, lo, cap = self.per_octave, self.min_keys, self.cap_octave
        base = n * lo
        q = p // base
        k = np.maximum(np.frexp(np.maximum(q, 1).astype(np.float64))[1] - 1, 1)  # floor(log2 q), q >= 2
        k = np.minimum(k, 62)
        octave = n * (k + 1) + (p - (base << k)) // (lo << k)
        capped = n * (cap + 1) + (p - (base << cap)) // self.max_keys
        return np.where(q < 2, p // lo, np.where(k >= cap, capped, octave))

    def start(self, j):
        """The first position of split(s) j."""
        j = np.asarray(j, np.int64)
        n, lo, cap = self.per_octave, self.min_keys, self.cap_octave
        base = n * lo
        k = np.clip(j // n - 1, 1, 62)
        octave = (base << np.minimum(k, cap)) + (j % n) * (lo << np.minimum(k, cap))
        capped = (base << cap) + (j - n * (cap + 1)) * self.max_keys
        return np.where(j < 2 * n, j * lo, np.where(k >= cap, capped, octave))


DEFAULT_SPLIT = SplitRule()


# ---- which keys a row sees -------------------------------------------------------------------
def key_bounds(mode: str, window_mode: str, pos, i, n, window: int):
    """[lo, hi) of the keys row(s) i of a session of n rows at pos see (int arrays broadcast):
    causal [0, pos + i]; block/anchor [pos - window, pos + n); block/row |pos + i - k| < window.
    The kernels compute the same (attn_row_lo / attn_row_hi, csrc/attention.cu)."""
    pos, i, n = (np.asarray(x, np.int64) for x in (pos, i, n))
    if mode == "causal":
        return np.zeros_like(pos + i), pos + i + 1
    if window_mode == "row":
        return np.maximum(0, pos + i - window + 1), np.minimum(pos + n, pos + i + window)
    return np.maximum(0, pos - window) + 0 * i, pos + n + 0 * i


def block_mode(mode: str, window_mode: str) -> int:
    """The kernels' block_mode argument: 0 causal, 1 block with the anchor's window, 2 per-row window."""
    return 0 if mode == "causal" else 2 if window_mode == "row" else 1


# ---- NumPy reference ------------------------------------------------------------------------


def _session_kv(k_cache, v_cache, k_rows, v_rows, pos, lo, hi, ring):
    """K, V [Hkv, L, D] f32 over whole tiles [key0, key0 + L) covering [lo, hi); zero outside."""
    hkv, capacity, d = k_cache.shape
    key0 = lo // TILE * TILE
    length = -(-hi // TILE) * TILE - key0
    k = np.zeros((hkv, length, d), np.float32)
    v = np.zeros((hkv, length, d), np.float32)
    committed = np.arange(lo, pos)
    slots = committed % capacity if ring else committed
    k[:, committed - key0] = to_f32(k_cache[:, slots])
    v[:, committed - key0] = to_f32(v_cache[:, slots])
    k[:, pos - key0 : hi - key0] = to_f32(k_rows).transpose(1, 0, 2)
    v[:, pos - key0 : hi - key0] = to_f32(v_rows).transpose(1, 0, 2)
    return k, v, key0


def _halving_sum(x: np.ndarray, axis: int) -> np.ndarray:
    """Sum over `axis` (a power of two long) by halving: x[:h] + x[h:] until one is left. One
    fixed order per row, whatever the other axes hold."""
    x = np.moveaxis(x, axis, 0)
    while x.shape[0] > 1:
        h = x.shape[0] // 2
        x = x[:h] + x[h:]
    return x[0]


def _merge(run, split, fa, fb):
    return run * fa + split * fb


class NumpyProducts:
    """A tile's two products, each elementwise and then a halving sum: q [n, Hkv, G, D] .
    kt [Hkv, L, D] over D, and p [n, Hkv, G, L] . vt [Hkv, L, D] over L. The numpy backend runs
    dspark.ops.host's native twin, bit for bit."""

    @staticmethod
    def scores(q, kt):
        return _halving_sum(q[:, :, :, None, :] * kt[None, :, None, :, :], axis=-1)

    @staticmethod
    def weighted(p, vt):
        return _halving_sum(p[..., None] * vt[None, :, None, :, :], axis=-2)


def _attend(q, k, v, key0, row_lo, row_hi, scale, split: SplitRule, p_dtype, products=NumpyProducts):
    """q [n, Hkv, G, D] f32; k, v [Hkv, L, D] from position key0; row r sees [row_lo[r], row_hi[r]).
    Per split: online softmax over its tiles; splits merged in increasing order. -> [n, Hkv, G, D]"""
    n, hkv, g, d = q.shape
    tiles = k.shape[1] // TILE
    f32, ninf = np.float32, np.float32(-np.inf)
    tile_split = split.index(key0 + TILE * np.arange(tiles + 1))
    M = np.full((n, hkv, g), ninf, f32)          # merged over the splits so far
    Lm = np.zeros((n, hkv, g), f32)
    A = np.zeros((n, hkv, g, d), f32)
    m, l, acc = M.copy(), Lm.copy(), A.copy()    # the current split
    split_seen = np.zeros((n, 1, 1), bool)
    with np.errstate(invalid="ignore", over="ignore"):
        for t in range(tiles):
            kt, vt = k[:, t * TILE : (t + 1) * TILE], v[:, t * TILE : (t + 1) * TILE]
            keypos = key0 + t * TILE + np.arange(TILE)
            visible = (keypos >= row_lo[:, None]) & (keypos < row_hi[:, None])     # [n, TILE]
            seen = visible.any(axis=1)[:, None, None]
            if seen.any():
                s = products.scores(q, kt) * scale
                s = np.where(visible[:, None, None, :], s, ninf)
                m_new = np.where(seen, np.maximum(m, s.max(axis=-1)), m)
                p = np.where(visible[:, None, None, :], np.exp(s - m_new[..., None]), f32(0))
                p = p.astype(p_dtype).astype(f32)  # the MMA's operand: p in the storage dtype
                alpha = np.where(seen, np.exp(m - m_new), f32(1))
                l = np.where(seen, l * alpha + _halving_sum(p, axis=-1), l)
                pv = products.weighted(p, vt)
                acc = np.where(seen[..., None], acc * alpha[..., None] + pv, acc)
                m = m_new
                split_seen |= seen
            if tile_split[t + 1] != tile_split[t] or t == tiles - 1:
                Mn = np.maximum(M, m)
                fa, fb = np.exp(M - Mn), np.exp(m - Mn)
                Lm = np.where(split_seen, _merge(Lm, l, fa, fb), Lm)
                A = np.where(split_seen[..., None], _merge(A, acc, fa[..., None], fb[..., None]), A)
                M = np.where(split_seen, Mn, M)
                m, l, acc = np.full_like(m, ninf), np.zeros_like(l), np.zeros_like(acc)
                split_seen[...] = False
    return A / Lm[..., None]


def attention_ref(q, k_blk, v_blk, k_caches, v_caches, pos, row_indptr, *, mode="causal", window=0,
                  scale=None, split: SplitRule | None = None, window_mode: str = "anchor",
                  products=NumpyProducts) -> np.ndarray:
    """The NumPy twin of the kernels: f32 output [rows, Hq, D] (the op rounds to q's dtype).
    `products`: NumpyProducts' twin to run instead (the numpy backend passes dspark.ops.host's)."""
    rows, hq, d = q.shape
    hkv = k_blk.shape[1]
    g = hq // hkv
    split = split or DEFAULT_SPLIT
    scale = np.float32(1.0 / math.sqrt(d) if scale is None else scale)
    p_dtype = np.dtype(q.dtype) if np.dtype(q.dtype).itemsize == 2 else np.dtype(np.float32)
    out = np.zeros((rows, hq, d), np.float32)
    chunk = max(1, _REF_BUDGET // (hq * TILE * d))  # rows per pass: the tile temporaries stay bounded
    for b in range(len(row_indptr) - 1):
        r0, r1 = int(row_indptr[b]), int(row_indptr[b + 1])
        if r0 == r1:
            continue
        p0, n = int(pos[b]), r1 - r0
        row_lo, row_hi = key_bounds(mode, window_mode, p0, np.arange(n), n, window)
        lo, hi = int(row_lo.min()), int(row_hi.max())
        k, v, key0 = _session_kv(k_caches[b], v_caches[b], k_blk[r0:r1], v_blk[r0:r1], p0, lo, hi, mode == "block")
        for c0 in range(r0, r1, chunk):
            c1 = min(r1, c0 + chunk)
            chunk_lo, chunk_hi = row_lo[c0 - r0 : c1 - r0], row_hi[c0 - r0 : c1 - r0]
            span = -(-int(chunk_hi.max()) // TILE) * TILE - key0  # the tiles these rows reach
            qf = to_f32(q[c0:c1]).reshape(c1 - c0, hkv, g, d)
            out[c0:c1] = _attend(qf, k[:, :span], v[:, :span], key0, chunk_lo, chunk_hi, scale, split,
                                 p_dtype, products).reshape(c1 - c0, hq, d)
    return out


# ---- validation and launch plan ---------------------------------------------------------------
@dataclass(frozen=True)
class AttentionCall:
    """A validated call: host copies of the small arrays and the shape facts the plan needs."""
    rows: int
    hq: int
    hkv: int
    head_dim: int
    dtype: np.dtype
    indptr: np.ndarray    # int32 [B+1]
    pos: np.ndarray       # int32 [B]
    capacity: np.ndarray  # int32 [B]
    mode: str
    window: int
    scale: np.float32
    window_mode: str = "anchor"

    @property
    def sessions(self) -> int:
        return self.pos.shape[0]


@dataclass(frozen=True)
class AttentionPlan:
    """What one attention call launches, and what it costs, without running anything.

    strategy "serial" (slots 0): `kernel` on `grid` (row chunks, Hkv, B) writes out. "parallel":
    `kernel` on (row chunks x slots, Hkv, B) writes split partials, `combine_kernel` on
    `combine_grid` (rows, Hq) merges them. `cta_keys` holds the keys each working CTA of the main
    kernel reads (CTAs the grid holds for other sessions' shapes leave at once and are not listed)."""
    strategy: str
    head_dim: int
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int]
    shared_mem: int
    rows_per_cta: int
    stages: int
    split: SplitRule
    slots: int                      # the partial buffer's split dimension (parallel); 0: serial
    combine_kernel: str | None
    combine_grid: tuple[int, int] | None
    combine_block: tuple[int] | None
    max_splits: int                 # the most splits any row of the call reaches
    cta_keys: np.ndarray            # int64 [working CTAs of the main kernel]
    idle_ctas: int                  # CTAs of the grid with no key (they leave at once)
    bytes: dict                     # kv, q, out, partials_written, partials_read
    flops: int                      # 4 D per (item, visible key): q.k and p.v multiply-adds

    @property
    def ctas(self) -> int:
        return int(self.cta_keys.size)

    @property
    def launches(self) -> int:
        return 1 if self.combine_kernel is None else 2

    @property
    def total_bytes(self) -> int:
        return int(sum(self.bytes.values()))

    @property
    def partial_bytes(self) -> int:
        """Size of the partial buffers the op allocates: [rows, Hq, slots, D + 2] f32 (0 for serial)."""
        if self.combine_grid is None:
            return 0
        return self.combine_grid[0] * self.combine_grid[1] * self.slots * (self.head_dim + 2) * 4


def config(itemsize: int, head_dim: int, limit: int = MAX_SHARED_MEM) -> tuple[int, int, str]:
    """(m-tiles, stages, entry suffix) of the serial and split kernels: CONFIGS' where a CTA of it fits
    `limit` bytes of shared memory (the device's, dspark.ops.linear.shared_limit), else the first of
    SMALL_CONFIGS' that does; CapacityError where none does."""
    key = (itemsize, head_dim)
    for i, (mt, stages) in enumerate((CONFIGS[key], *SMALL_CONFIGS.get(key, ()))):
        if shared_mem_bytes(itemsize, head_dim, mt, stages) <= limit:
            return mt, stages, f"_m{mt}s{stages}" if i else ""
    raise CapacityError(f"head_dim={head_dim} over {itemsize}-byte K/V: the attention kernels need "
                        f"{shared_mem_bytes(itemsize, head_dim, mt, stages)} bytes of shared memory a CTA, "
                        f"this device gives {limit} (16-bit K/V take less)")


def shared_mem_bytes(itemsize: int, head_dim: int, mt: int | None = None, stages: int | None = None) -> int:
    """Dynamic shared memory of one CTA (AttnLayout, csrc/attention.cuh) of CONFIGS' shape, or of
    (mt, stages)."""
    if mt is None:
        mt, stages = CONFIGS[(itemsize, head_dim)]
    items, pad = 16 * mt, 16 // itemsize
    row, prow = head_dim + pad, TILE + pad
    return itemsize * (2 * stages * TILE * row + items * (row + prow)) + 4 * (2 * WARPS + 4) * items


def prompt_shared_mem_bytes(itemsize: int, head_dim: int) -> int:
    """Dynamic shared memory of the prompt kernel (AttnPromptLayout, csrc/attention.cu): one K and
    one V tile and the CTA's PROMPT_ITEMS items' q in the storage dtype (their merged output lives in
    global memory, `prompt_acc_bytes`)."""
    row = head_dim + 16 // itemsize
    return itemsize * (2 * TILE * row + PROMPT_ITEMS * row)


def prompt_acc_bytes(rows: int, hq: int, head_dim: int) -> int:
    """The prompt kernel's merged outputs over the splits so far, f32 [rows, Hq, D] in the pass's
    workspace (part_acc): each CTA's items' rows, zeroed, read and written at each split's end,
    read by the final store."""
    return 4 * rows * hq * head_dim


def max_gqa(itemsize: int, head_dim: int, limit: int = MAX_SHARED_MEM) -> int:
    """The most query heads per kv head one CTA holds (one row's heads must share a CTA)."""
    return 16 * config(itemsize, head_dim, limit)[0]


def reach_splits(lens, reach: int, *, mode: str = "causal", window: int = 0, window_mode: str = "anchor",
                 split: SplitRule | None = None) -> int:
    """The most splits a session's rows span at any position they can take below `reach` (the
    rows of a session of lens[b] rows at pos <= reach - lens[b]): what a grid sized for `reach`
    must hold. Causal rows span the most at the highest position; a window's span is taken at every
    position (it is largest where splits are shortest and a boundary falls inside it)."""
    split = split or DEFAULT_SPLIT
    lens = np.asarray(lens, np.int64).reshape(-1)
    if not lens.size or reach < 1:
        return 1
    return max(_reach_splits(int(n), int(reach), mode, int(window), window_mode, split) for n in set(lens.tolist()))


@functools.lru_cache(maxsize=256)
def _reach_splits(n: int, reach: int, mode: str, window: int, window_mode: str, split: SplitRule) -> int:
    top = max(reach - n, 0)
    if mode == "causal":
        return int(split.index(top + n - 1)) + 1
    p = np.arange(top + 1, dtype=np.int64)
    lo = np.maximum(0, p - window + 1) if window_mode == "row" else np.maximum(0, p - window)
    return int((split.index(p + n - 1) - split.index(lo)).max()) + 1


def launch_plan(lens, pos, *, hq: int, hkv: int, head_dim: int, dtype="bfloat16", mode: str = "causal",
                window: int = 0, split: SplitRule | None = None, strategy: str = "auto", sms: int = SMS,
                window_mode: str = "anchor", reach: int | None = None, limit: int = MAX_SHARED_MEM) -> AttentionPlan:
    """The launch plan of an attention call: sessions of `lens[b]` rows at positions `pos[b]`,
    Hq / Hkv heads of `head_dim`, storage `dtype`. Pure: nothing is allocated or launched, so a
    performance model can price a call (bytes, CTAs, their keys, launches) from shapes alone.
    `split` and `strategy` ("auto", "serial", "parallel", "prompt") are for tests and tuning; the
    result never depends on them. `reach`: size the grid for rows at any position up to it (a
    recorded or captured pass, whose positions move on while its grid stays: CTAs past the live keys
    leave at once), not only for `pos`. `limit`: the shared memory a CTA may take on the device
    (`config`: an A100's 163 KB take SMALL_CONFIGS at D = 256; a prompt that would not fit walks
    serially)."""
    dtype = BF16 if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype)
    kind = suffix(dtype, "dtype")
    check_strategy(strategy, dtype, mode)
    split = split or DEFAULT_SPLIT
    lens, pos = np.asarray(lens, np.int64).reshape(-1), np.asarray(pos, np.int64).reshape(-1)
    isz, g = dtype.itemsize, hq // hkv
    mt, stages, entry = config(isz, head_dim, limit)
    prompt = strategy == "prompt" or (strategy == "auto" and isz == 2 and mode == "causal"
                                      and int(lens.max(initial=0)) >= PROMPT_MIN_ROWS)
    if prompt and prompt_shared_mem_bytes(isz, head_dim) > limit:   # sm_86 / sm_89 at D = 256
        if strategy == "prompt":
            raise CapacityError(f"strategy='prompt' at head_dim={head_dim}: the prompt kernel needs "
                                f"{prompt_shared_mem_bytes(isz, head_dim)} bytes of shared memory a CTA, "
                                f"this device gives {limit}")
        prompt = False
    rows_per_cta = max(1, (PROMPT_ITEMS if prompt else 16 * mt) // g)
    rows = int(lens.sum())

    def bounds(s, i):  # key_bounds of rows i of sessions s
        return key_bounds(mode, window_mode, pos[s], i, lens[s], window)

    # Per (session, row chunk): items, the key range [lo, hi) of its rows, and the splits it spans;
    # split-parallel slots count from the session's first split (row 0's), as the kernels do.
    chunk_n = -(-lens // rows_per_cta)
    sess = np.repeat(np.arange(lens.size), chunk_n)
    r0 = (np.arange(int(chunk_n.sum())) - np.repeat(np.cumsum(chunk_n) - chunk_n, chunk_n)) * rows_per_cta
    r = np.minimum(rows_per_cta, lens[sess] - r0)
    lo, hi = bounds(sess, r0)[0], bounds(sess, r0 + r - 1)[1]
    j0 = split.index(lo)
    count = split.index(hi - 1) - j0 + 1
    max_splits = int((split.index(hi - 1) - split.index(bounds(sess, 0 * r0)[0]) + 1).max(initial=1))
    if reach is not None:
        max_splits = max(max_splits, reach_splits(lens, reach, mode=mode, window=window, window_mode=window_mode,
                                                  split=split))
    chunks = int(chunk_n.max(initial=0))
    partials = rows * hq * max_splits * (head_dim + 2) * 4
    if strategy == "auto":
        parallel = not prompt and max_splits > 1 and partials <= PARTIAL_BUDGET and sess.size * hkv < 2 * sms
    else:
        parallel = strategy == "parallel"
    if parallel:  # one CTA per (chunk, split it spans, kv head)
        owner = np.repeat(np.arange(sess.size), count)
        j = np.repeat(j0, count) + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        seg = np.minimum(split.start(j + 1), hi[owner]) - np.maximum(split.start(j), lo[owner])
    else:
        owner, seg = np.arange(sess.size), hi - lo
    cta_keys = np.repeat(seg, hkv)

    # Useful work: every item's visible keys; partials: each (row, head, split it reaches).
    row_sess = np.repeat(np.arange(lens.size), lens)
    row_i = np.arange(rows) - np.repeat(np.cumsum(lens) - lens, lens)
    row_lo, row_hi = bounds(row_sess, row_i)
    row_splits = int((split.index(row_hi - 1) - split.index(row_lo) + 1).sum())
    by = {
        "kv": int(cta_keys.sum()) * 2 * head_dim * isz,   # K and V of each CTA's keys, once per kv head
        "q": int((r * g)[owner].sum()) * hkv * head_dim * isz,  # each CTA stages its items' q
        "out": rows * hq * head_dim * isz,
        # Written by the split kernel, read back by the combine (from L2 when it still holds them).
        "partials_written": row_splits * hq * (head_dim + 2) * 4 if parallel else 0,
        "partials_read": row_splits * hq * (head_dim + 2) * 4 if parallel else 0,
    }
    visible = int((row_hi - row_lo).sum())
    slots = max_splits if parallel else 0
    grid = (chunks * max(slots, 1), hkv, len(lens))
    idle = int(np.prod(grid)) - int(cta_keys.size)
    if prompt:
        return AttentionPlan(
            strategy="prompt", head_dim=head_dim, kernel=f"attention_prompt_{kind}_d{head_dim}", grid=grid,
            block=(PROMPT_THREADS,), shared_mem=prompt_shared_mem_bytes(isz, head_dim), rows_per_cta=rows_per_cta,
            stages=1, split=split, slots=0, combine_kernel=None, combine_grid=None, combine_block=None,
            max_splits=max_splits, cta_keys=cta_keys, idle_ctas=idle, bytes=by,
            flops=4 * head_dim * g * hkv * visible)
    name = f"attention_{kind}_d{head_dim}{entry}"
    return AttentionPlan(
        strategy="parallel" if parallel else "serial", head_dim=head_dim, kernel=name, grid=grid, block=(32 * WARPS,),
        shared_mem=shared_mem_bytes(isz, head_dim, mt, stages), rows_per_cta=rows_per_cta, stages=stages, split=split,
        slots=slots, combine_kernel=f"attention_combine_{kind}" if parallel else None,
        combine_grid=(rows, hq) if parallel else None, combine_block=(COMBINE_THREADS,) if parallel else None,
        max_splits=max_splits, cta_keys=cta_keys, idle_ctas=idle, bytes=by, flops=4 * head_dim * g * hkv * visible)


def check_strategy(strategy: str, dtype, mode: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {STRATEGIES}")
    if strategy == "prompt" and (np.dtype(dtype).itemsize != 2 or mode != "causal"):
        raise ValueError(f"strategy='prompt' runs causal attention over 16-bit K/V, not {np.dtype(dtype)} in "
                         f"mode {mode!r}")


def validate(be, q, k_blk, v_blk, k_caches, v_caches, pos, row_indptr, mode, window, scale,
             window_mode: str = "anchor", limit: int = MAX_SHARED_MEM) -> AttentionCall:
    require_ndim(q, 3, "q", "[rows, Hq, D]")
    suffix(q.dtype, "q")
    rows, hq, d = q.shape
    if d not in HEAD_DIMS:
        raise ShapeError(f"q has head dim {d}: expected one of {HEAD_DIMS}")
    require_ndim(k_blk, 3, "k_blk", "[rows, Hkv, D]")
    hkv = k_blk.shape[1]
    require_shape(k_blk, (rows, hkv, d), "k_blk")
    require_shape(v_blk, (rows, hkv, d), "v_blk")
    for name, a in (("k_blk", k_blk), ("v_blk", v_blk)):
        _require_same_dtype(a, q.dtype, name)
    if hkv == 0 or hq % hkv:
        raise ShapeError(f"q has {hq} heads: expected a multiple of the {hkv} kv heads of k_blk")
    if hq // hkv > max_gqa(q.dtype.itemsize, d, limit):
        raise ShapeError(f"q has {hq // hkv} query heads per kv head: at most {max_gqa(q.dtype.itemsize, d, limit)} "
                         f"for {q.dtype} at head dim {d} (one row's heads share a CTA)")
    indptr = be.to_host(row_indptr)
    require_indptr(indptr, "row_indptr", rows)
    sessions = indptr.shape[0] - 1
    pos = be.to_host(pos)
    require_ndim(pos, 1, "pos", "[B]")
    require_dtype(pos, np.int32, "pos")
    require_shape(pos, (sessions,), "pos")
    if np.any(pos < 0):
        b = int(np.flatnonzero(pos < 0)[0])
        raise CapacityError(f"pos[{b}]={int(pos[b])}: expected a position >= 0")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    if not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"window={window!r}: expected an int >= 0")
    if mode == "causal" and window:
        raise ValueError(f"window={window} applies only to mode='block' (the drafter's ring)")
    if window_mode not in WINDOW_MODES:
        raise ValueError(f"window_mode={window_mode!r}: expected one of {WINDOW_MODES}")
    if window_mode == "row" and (mode != "block" or window < 1):
        raise ValueError(f"window_mode='row' with mode={mode!r}, window={window}: a per-row window is a block-mode "
                         f"window of at least 1 row (a row always sees itself)")
    capacity = np.zeros(sessions, np.int32)
    for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        if not isinstance(caches, (list, tuple)) or len(caches) != sessions:
            n = len(caches) if isinstance(caches, (list, tuple)) else type(caches).__name__
            raise ShapeError(f"{name} has {n} entries: expected a list of one cache per session ({sessions})")
    lengths = np.diff(indptr)
    for b in range(sessions):
        kc, vc = k_caches[b], v_caches[b]
        require_ndim(kc, 3, f"k_caches[{b}]", "[Hkv, capacity, D]")
        if kc.shape[0] != hkv or kc.shape[2] != d:
            raise ShapeError(f"k_caches[{b}] has shape {tuple(kc.shape)}: expected ({hkv}, capacity, {d})")
        require_shape(vc, kc.shape, f"v_caches[{b}]")
        _require_same_dtype(kc, q.dtype, f"k_caches[{b}]")
        _require_same_dtype(vc, q.dtype, f"v_caches[{b}]")
        capacity[b] = kc.shape[1]
        if mode == "causal" and int(pos[b]) + int(lengths[b]) > capacity[b]:
            raise CapacityError(f"session {b}: pos={int(pos[b])} + {int(lengths[b])} rows exceeds the cache "
                                f"capacity {capacity[b]} of k_caches[{b}]")
        # The ring must hold every committed row some block row sees: the anchor's window, or
        # row 0's window - 1 rows below itself.
        need = window - 1 if window_mode == "row" else window
        if mode == "block" and need > capacity[b]:
            row = window_mode == "row"
            raise CapacityError(f"window={window} exceeds the ring capacity {capacity[b]}{' + 1' if row else ''} of "
                                f"k_caches[{b}]" + (" (a per-row window reaches window - 1 committed rows)" if row else ""))
        if int(pos[b]) + int(lengths[b]) + (window if window_mode == "row" else 0) > np.iinfo(np.int32).max:
            raise CapacityError(f"session {b}: positions up to pos + rows (+ window) must fit in int32")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if not np.isfinite(scale):
        raise ValueError(f"scale={scale!r}: expected a finite float")
    return AttentionCall(rows, hq, hkv, d, q.dtype, indptr, pos, capacity, mode, int(window), np.float32(scale),
                         window_mode)


def _require_same_dtype(a, dtype, what: str) -> None:
    if a.dtype != dtype:
        raise DTypeError(f"{what} has dtype {a.dtype}: expected {dtype} (the dtype of q)")


def plan(call: AttentionCall, split: SplitRule | None = None, strategy: str = "auto",
         reach: int | None = None, limit: int = MAX_SHARED_MEM) -> AttentionPlan:
    """The launch plan of a validated call (launch_plan on its shapes) for a device whose CTAs take
    `limit` bytes of shared memory."""
    return launch_plan(np.diff(call.indptr), call.pos, hq=call.hq, hkv=call.hkv, head_dim=call.head_dim,
                       dtype=call.dtype, mode=call.mode, window=call.window, split=split, strategy=strategy,
                       window_mode=call.window_mode, reach=reach, limit=limit)


# ---- the op -----------------------------------------------------------------------------------
def attention(be, q, k_blk, v_blk, k_caches, v_caches, pos, row_indptr, *, mode="causal", window=0, scale=None,
              out=None, split: SplitRule | None = None, strategy: str = "auto", window_mode: str = "anchor",
              capacity=None, reach: int | None = None, ws=None):
    """Attention of `q` [rows, Hq, D] over each session's cache and block rows -> out [rows, Hq, D]
    (dtype of q; `out=` may be given, e.g. poisoned by a test).

    k_blk / v_blk [rows, Hkv, D]: the block's own K/V rows (Hq a multiple of Hkv, D 64, 128 or 256
    in f32, f16 and bf16; f32 at D 256 loads its tiles single-buffered, two stages would not fit in
    shared memory).
    k_caches / v_caches: lists, one per session, of [Hkv, capacity, D] (or PointerTables of them,
    dspark.ops.tables: the batch's tables, validated and uploaded once). pos: int32 [B], the
    committed rows per session; row_indptr: int32 [B+1]. mode "causal": row i of session b sees
    [0, pos[b] + i]; mode "block": the caches are rings of their capacity and every row sees the
    last `window` committed rows plus the whole block (window_mode "anchor"), or row i the keys
    within `window` of its own position pos[b] + i, both ways (window_mode "row"; a ring of at least
    window - 1 rows). scale defaults to 1/sqrt(D). `split` (where the key axis is cut, SplitRule)
    and `strategy` ("auto", "serial", "parallel", "prompt") are test and tuning knobs: the results
    depend on `split` within rounding, never on `strategy`.

    A recorded or captured pass: pos, row_indptr and `capacity` (int32 [B], each session's cache
    rows) given as Staged arrays are read from their device copies (no upload), `reach` sizes the
    grid for the positions the pass will see (launch_plan), and `ws` (dspark.ops.workspace) holds
    the split partials.
    """
    if split is not None and not isinstance(split, SplitRule):
        raise TypeError(f"split={split!r}: expected a SplitRule")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {STRATEGIES}")
    q, k_blk, v_blk, pos, row_indptr, out = adopt(be, q=q, k_blk=k_blk, v_blk=v_blk, pos=pos, row_indptr=row_indptr,
                                                  out=out, writes=("out",))
    # Tables (dspark.ops.tables) were validated when made: their arrays are checked for shape
    # here, their addresses are not uploaded again.
    tabled = isinstance(k_caches, PointerTable) and isinstance(v_caches, PointerTable)
    if tabled:
        k_caches.require("k_caches", align=16)
        v_caches.require("v_caches", align=16)
        k_tab, v_tab = k_caches.device, v_caches.device
        k_caches, v_caches = list(k_caches.arrays), list(v_caches.arrays)
    else:
        k_caches, v_caches = adopt(be, k_caches=k_caches, v_caches=v_caches)
    limit = shared_limit(be)
    call = validate(be, q, k_blk, v_blk, k_caches, v_caches, pos, row_indptr, mode, window, scale, window_mode,
                    limit)
    if out is None:
        out = be.xp.empty(q.shape, q.dtype)
    require_shape(out, q.shape, "out")
    _require_same_dtype(out, q.dtype, "out")
    if be.kernels is None:
        out[...] = attention_ref(q, k_blk, v_blk, k_caches, v_caches, call.pos, call.indptr, mode=mode,
                                 window=call.window, scale=call.scale, split=split,
                                 window_mode=window_mode, products=host.attention_products if host.NATIVE else NumpyProducts).astype(q.dtype)
        return out
    launch = plan(call, split, strategy, reach, limit)
    if call.rows == 0:
        return out
    B, xp = call.sessions, be.xp
    q, k_blk, v_blk = (xp.ascontiguousarray(a) for a in (q, k_blk, v_blk))
    caches = [] if tabled else [*k_caches, *v_caches]
    require_kernel_buffers(be, [q, k_blk, v_blk, out, *caches],
                           ["q", "k_blk", "v_blk", "out", *(f"k_caches[{b}]" for b in range(len(caches) // 2)),
                            *(f"v_caches[{b}]" for b in range(len(caches) // 2))])
    if all(isinstance(a, Staged) for a in (pos, row_indptr, capacity)):
        if not np.array_equal(capacity.host, call.capacity):
            raise ShapeError(f"capacity={capacity.host.tolist()}: expected the caches' rows {call.capacity.tolist()}")
        indptr, pos_d, cap = row_indptr.device, pos.device, capacity.device
    else:  # one upload for the small per-session arrays (and, without tables, one for both tables)
        meta = be.asarray(np.concatenate([call.indptr, call.pos, call.capacity]).astype(np.int32))
        indptr, pos_d, cap = meta[: B + 1], meta[B + 1 : 2 * B + 1], meta[2 * B + 1 :]
    if not tabled:
        tables = be.pointer_table(caches)
        k_tab, v_tab = tables[:B], tables[B:]
    d, rule = call.head_dim, launch.split
    parallel = launch.combine_kernel is not None
    part_acc = buffer(be, ws, f"attention.part_acc.{call.hq}.{launch.slots}.{d}", call.rows,
                      (call.hq, launch.slots, d)) if parallel else None
    if launch.strategy == "prompt":   # the merged outputs: every element written before it is read
        part_acc = buffer(be, ws, f"attention.prompt_acc.{call.hq}.{d}", call.rows, (call.hq, d))
    part_ml = buffer(be, ws, f"attention.part_ml.{call.hq}.{launch.slots}", call.rows,
                     (call.hq, launch.slots, 2)) if parallel else None
    kind = np.int32(block_mode(mode, window_mode))
    common = (np.int32(call.hq), np.int32(call.hkv), np.int32(launch.rows_per_cta), kind,
              np.int32(call.window), call.scale, np.int32(rule.min_keys), np.int32(rule.per_octave),
              np.int32(rule.max_keys), np.int32(launch.slots))
    be.kernels.get_function(launch.kernel)(
        launch.grid, launch.block,
        (q, k_blk, v_blk, k_tab, v_tab, indptr, pos_d, cap, *common, part_acc, part_ml, None if parallel
         else out),
        shared_mem=launch.shared_mem)
    if parallel:
        be.kernels.get_function(launch.combine_kernel)(
            launch.combine_grid, launch.combine_block,
            (indptr, pos_d, np.int32(B), kind, np.int32(call.window), np.int32(rule.min_keys),
             np.int32(rule.per_octave), np.int32(rule.max_keys), np.int32(launch.slots), np.int32(call.hq),
             np.int32(d), part_acc, part_ml, out))
    return out
