"""Row-invariant GQA attention over per-session KV caches plus the block's own K/V
(kernel: csrc/attention.cu).

Queries `q` [rows, Hq, D] are ragged over sessions by `row_indptr`; row i of session b sits at
absolute position pos[b] + i. Keys at positions p < pos[b] come from the session's cache
[Hkv, capacity, D] (slot p, or p % capacity for the drafter's ring), keys at p >= pos[b] from the
session's block rows in `k_blk` / `v_blk` [rows, Hkv, D]. Modes:

* ``causal`` (trunk prefill, decode, verify): row i sees [0, pos[b] + i], bottom-right aligned.
* ``block`` (drafter): every row sees the window [max(0, pos[b] - window), pos[b]) of committed
  rows plus the whole block.

Row invariance (DESIGN section 3): keys are walked in tiles at absolute positions
[64t, 64t + 64), in one reduction order (online softmax over tiles in increasing order, fixed
orders inside a tile and over D), and a tile a row cannot see leaves its state untouched. A
verify row is therefore bitwise equal to the decode step at its position, and a session's rows do
not depend on what else is batched. `attention_ref` follows the same recurrence with
shape-independent NumPy reductions (elementwise products and explicit pairwise halving sums, never
matmul or an axis-sum whose order NumPy may pick by shape), so the numpy backend is row-invariant
too. Its q.k and p.v sums halve pairwise rather than run in the kernel's sequential order: a few
whole-array adds instead of one per key keep the CPU path fast, and the two orders agree within
the tolerance the tests state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..dtypes import suffix, to_f32
from ..errors import CapacityError, DTypeError, ShapeError
from ..arrays import adopt
from .checks import require_dtype, require_indptr, require_ndim, require_shape
from .kv_commit import require_kernel_buffers

TILE = 64                # keys per tile; tiles sit at absolute positions
HEAD_DIMS = (64, 128)
MODES = ("causal", "block")
ITEMS_PER_CTA = 64       # query rows x GQA heads sharing one staged K/V tile: a verify block of
                         # 8 rows at GQA 8 still reads its K/V once
MAX_SHARED_MEM = 227 * 1024
_REF_BUDGET = 1 << 22    # scores per NumPy pass (rows x Hq x keys): bounds memory, changes no result


# ---- NumPy reference ------------------------------------------------------------------------
def _key_range(mode: str, pos: int, n: int, window: int) -> tuple[int, int]:
    """[lo, hi): the positions some row of the session sees."""
    lo = max(0, pos - window) if mode == "block" else 0
    return lo, pos + n


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


def _attend(q, k, v, key0, row_lo, row_hi, scale):
    """q [n, Hkv, G, D] f32; k, v [Hkv, L, D]; row r sees keys [row_lo, row_hi[r]). -> [n, Hkv, G, D]."""
    n, hkv, g, d = q.shape
    length = k.shape[1]
    tiles = length // TILE
    s = _halving_sum(q.reshape(n, hkv, g, 1, d) * k.reshape(1, hkv, 1, length, d), axis=-1) * scale
    keypos = key0 + np.arange(length)
    visible = (keypos >= row_lo) & (keypos < row_hi[:, None])  # [n, L]
    s = np.where(visible[:, None, None, :], s, np.float32(-np.inf)).reshape(n, hkv, g, tiles, TILE)
    # Running max after each tile; a tile a row cannot see adds -inf and changes nothing.
    m = np.maximum.accumulate(s.max(axis=-1), axis=-1)  # [n, Hkv, G, T]
    p = np.exp(s - np.where(np.isneginf(m), np.float32(0), m)[..., None])  # invisible -> exactly 0
    l_tile = _halving_sum(p, axis=-1)  # the kernel's lane sums then butterfly: the same halving
    # An invisible key adds p * v = +-0, which changes no bit of the sum.
    pv = _halving_sum(p[..., None] * v.reshape(1, hkv, 1, tiles, TILE, d), axis=-2)
    seen = visible.reshape(n, tiles, TILE).any(axis=-1)[:, None, None, :]  # [n, 1, 1, T]
    m_run = np.full((n, hkv, g), -np.inf, np.float32)
    l_run = np.zeros((n, hkv, g), np.float32)
    acc = np.zeros((n, hkv, g, d), np.float32)
    with np.errstate(invalid="ignore"):  # exp(-inf - -inf) on skipped tiles, discarded below
        for t in range(tiles):
            alpha = np.exp(m_run - m[..., t])
            step = seen[..., t]
            l_run = np.where(step, l_run * alpha + l_tile[..., t], l_run)
            acc = np.where(step[..., None], acc * alpha[..., None] + pv[..., t, :], acc)
            m_run = np.where(step, m[..., t], m_run)
    return acc / l_run[..., None]


def attention_ref(q, k_blk, v_blk, k_caches, v_caches, pos, row_indptr, *, mode="causal", window=0,
                  scale=None) -> np.ndarray:
    """The NumPy twin of the kernel: f32 output [rows, Hq, D] (the op rounds to q's dtype)."""
    rows, hq, d = q.shape
    hkv = k_blk.shape[1]
    g = hq // hkv
    scale = np.float32(1.0 / math.sqrt(d) if scale is None else scale)
    out = np.zeros((rows, hq, d), np.float32)
    for b in range(len(row_indptr) - 1):
        r0, r1 = int(row_indptr[b]), int(row_indptr[b + 1])
        if r0 == r1:
            continue
        p0 = int(pos[b])
        lo, hi = _key_range(mode, p0, r1 - r0, window)
        k, v, key0 = _session_kv(k_caches[b], v_caches[b], k_blk[r0:r1], v_blk[r0:r1], p0, lo, hi, mode == "block")
        chunk = max(1, _REF_BUDGET // (hq * k.shape[1]))
        for c0 in range(r0, r1, chunk):
            c1 = min(r1, c0 + chunk)
            row_hi = np.full(c1 - c0, hi) if mode == "block" else p0 + np.arange(c0 - r0, c1 - r0) + 1
            qf = to_f32(q[c0:c1]).reshape(c1 - c0, hkv, g, d)
            out[c0:c1] = _attend(qf, k, v, key0, lo, row_hi, scale).reshape(c1 - c0, hq, d)
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

    @property
    def sessions(self) -> int:
        return self.pos.shape[0]


@dataclass(frozen=True)
class AttentionPlan:
    grid: tuple[int, int, int]   # (row chunks, Hkv, B)
    block: tuple[int]
    shared_mem: int
    rows_per_cta: int


def validate(be, q, k_blk, v_blk, k_caches, v_caches, pos, row_indptr, mode, window, scale) -> AttentionCall:
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
        if mode == "block" and window > capacity[b]:
            raise CapacityError(f"window={window} exceeds the ring capacity {capacity[b]} of k_caches[{b}]")
        if int(pos[b]) + int(lengths[b]) > np.iinfo(np.int32).max:
            raise CapacityError(f"session {b}: positions up to pos + rows must fit in int32")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if not np.isfinite(scale):
        raise ValueError(f"scale={scale!r}: expected a finite float")
    return AttentionCall(rows, hq, hkv, d, q.dtype, indptr, pos, capacity, mode, int(window), np.float32(scale))


def _require_same_dtype(a, dtype, what: str) -> None:
    if a.dtype != dtype:
        raise DTypeError(f"{what} has dtype {a.dtype}: expected {dtype} (the dtype of q)")


def plan(call: AttentionCall) -> AttentionPlan:
    """One CTA per (row chunk, kv head, session). The chunk is fixed by G alone (never by the
    other sessions), and each item's arithmetic is independent of the chunk and block size."""
    g = call.hq // call.hkv
    rows_per_cta = max(1, ITEMS_PER_CTA // g)
    longest = int(np.diff(call.indptr).max(initial=0))
    chunks = -(-longest // rows_per_cta)
    items = min(longest, rows_per_cta) * g  # the largest CTA's; each CTA carves for its own
    warps = 4 if items <= 4 else 8
    isz = call.dtype.itemsize
    smem = (TILE * (call.head_dim + 16 // isz) * isz + TILE * call.head_dim * isz  # K (padded), V tiles
            + 2 * items * call.head_dim * 4 + warps * TILE * 4 + 2 * items * 4)  # q, acc, p, (m, l)
    if smem > MAX_SHARED_MEM:
        raise CapacityError(f"{g} query heads per kv head need {smem} bytes of shared memory per CTA: "
                            f"more than {MAX_SHARED_MEM}")
    return AttentionPlan((chunks, call.hkv, call.sessions), (32 * warps,), smem, rows_per_cta)


# ---- the op -----------------------------------------------------------------------------------
def attention(be, q, k_blk, v_blk, k_caches, v_caches, pos, row_indptr, *, mode="causal", window=0, scale=None,
              out=None):
    """Attention of `q` [rows, Hq, D] over each session's cache and block rows -> out [rows, Hq, D]
    (dtype of q; `out=` may be given, e.g. poisoned by a test).

    k_blk / v_blk [rows, Hkv, D]: the block's own K/V rows (Hq a multiple of Hkv, D 64 or 128).
    k_caches / v_caches: lists, one per session, of [Hkv, capacity, D]. pos: int32 [B], the
    committed rows per session; row_indptr: int32 [B+1]. mode "causal": row i of session b sees
    [0, pos[b] + i]; mode "block": the caches are rings of their capacity and every row sees the
    last `window` committed rows plus the whole block. scale defaults to 1/sqrt(D).
    """
    q, k_blk, v_blk, k_caches, v_caches, pos, row_indptr, out = adopt(
        be, q=q, k_blk=k_blk, v_blk=v_blk, k_caches=k_caches, v_caches=v_caches, pos=pos, row_indptr=row_indptr,
        out=out, writes=("out",))
    call = validate(be, q, k_blk, v_blk, k_caches, v_caches, pos, row_indptr, mode, window, scale)
    if out is None:
        out = be.xp.empty(q.shape, q.dtype)
    require_shape(out, q.shape, "out")
    _require_same_dtype(out, q.dtype, "out")
    if be.kernels is None:
        out[...] = attention_ref(q, k_blk, v_blk, k_caches, v_caches, call.pos, call.indptr, mode=mode,
                                 window=call.window, scale=call.scale).astype(q.dtype)
        return out
    launch = plan(call)
    if call.rows == 0:
        return out
    B = call.sessions
    q, k_blk, v_blk = (be.xp.ascontiguousarray(a) for a in (q, k_blk, v_blk))
    require_kernel_buffers(be, [q, k_blk, v_blk, out, *k_caches, *v_caches],
                           ["q", "k_blk", "v_blk", "out", *(f"k_caches[{b}]" for b in range(B)),
                            *(f"v_caches[{b}]" for b in range(B))])
    # One upload for the small per-session arrays and one for both pointer tables.
    meta = be.asarray(np.concatenate([call.indptr, call.pos, call.capacity]).astype(np.int32))
    tables = be.pointer_table([*k_caches, *v_caches])
    fn = be.kernels.get_function(f"attention_{suffix(q.dtype, 'q')}_d{call.head_dim}")
    fn(launch.grid, launch.block,
       (q, k_blk, v_blk, tables[:B], tables[B:], meta[: B + 1], meta[B + 1 : 2 * B + 1], meta[2 * B + 1 :],
        np.int32(call.hq), np.int32(call.hkv), np.int32(launch.rows_per_cta), np.int32(mode == "block"),
        np.int32(call.window), call.scale, out),
       shared_mem=launch.shared_mem)
    return out
