"""One attention layer's q, k and v made ready for the attention kernel in one launch (kernel:
csrc/rope.cu): each query and key head RMS-normed where the model norms them, rotated (RoPE,
rotate-half over the first `rot` dims of a head) at its row's absolute position, and every head of
q, k and v rounded to the K/V storage dtype into its own [rows, heads, D] array.

Positions come from device memory: row r of session b sits at pos[b] + r - row_indptr[b] (pos and
row_indptr host or Staged arrays, validated on the host, read by the kernel), so a pass recorded or
captured once runs at the positions of the round it replays. The angle is p * inv_freq in f64,
cos and sin rounded once to f32 and scaled by the attention factor (YaRN), as
dspark.ops.dense.rope_table computes its table; the norm sums in rmsnorm_f32's lane order.

`qk_prepare_ref` is the NumPy twin (the numpy backend's implementation): the norm is
dspark.ops.norm's (`norm=numpy_rmsnorm` on the numpy backend, `rmsnorm_ref` for the kernel's bits),
the rotation dspark.ops.dense.rope's; cos and sin of f64 angles agree with the device's to the
last bit of f64 before the f32 rounding (the tests allow an f32 ulp).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..arrays import adopt
from ..dtypes import suffix
from ..errors import ShapeError
from . import dense
from .checks import host_and_device, require_dtype, require_indptr, require_ndim, require_shape
from .norm import numpy_rmsnorm, rmsnorm_ref

F32 = np.float32
WARPS = 8           # kRopeWarps: head slots per CTA
MAX_DIM = 256       # kRopeMaxDim


@dataclass(frozen=True)
class Heads:
    """Where each head of a projection row lives: q heads at q_off + h * q_head (q_head = D, or 2 D
    when an output gate follows each query), k heads at k_off + h * D, v heads at v_off + h * D."""
    hq: int
    hkv: int
    D: int
    q_off: int
    q_head: int
    k_off: int
    v_off: int

    @classmethod
    def packed(cls, hq: int, hkv: int, D: int, gated: bool = False) -> "Heads":
        """[q (and gate) heads | k heads | v heads], as the fused projection writes them."""
        nq = hq * D * (2 if gated else 1)
        return cls(hq, hkv, D, 0, 2 * D if gated else D, nq, nq + hkv * D)

    @property
    def width(self) -> int:
        return self.v_off + self.hkv * self.D


@dataclass(frozen=True)
class Rotary:
    """RoPE over the first `rot` dims of each head: inv_freq f32 [rot / 2] and the attention factor
    (dspark.ops.dense.rope_frequencies)."""
    rot: int
    inv_freq: np.ndarray
    factor: float

    @classmethod
    def of(cls, rot: int, theta: float, scaling: tuple = ()) -> "Rotary":
        inv, factor = dense.rope_frequencies(rot, theta, scaling)
        return cls(rot, inv, factor)


def row_positions(pos, row_indptr) -> np.ndarray:
    """Absolute position of every row: pos[b] + r - row_indptr[b] for the rows of session b."""
    pos, indptr = np.asarray(pos, np.int64), np.asarray(row_indptr, np.int64)
    lens = np.diff(indptr)
    return np.repeat(pos - indptr[:-1], lens) + np.arange(int(indptr[-1]))


def qk_prepare_ref(src, heads: Heads, rotary: Rotary, positions, q_norm=None, k_norm=None, eps: float = 1e-6,
                   dtype=np.float32, norm=rmsnorm_ref):
    """(q, k, v) of projection rows src [rows, width] f32 at `positions` [rows], in `dtype`."""
    rows = src.shape[0]
    h, D = heads, heads.D

    def cut(off, stride, n):
        return np.stack([src[:, off + i * stride : off + i * stride + D] for i in range(n)], axis=1) if n else \
            np.zeros((rows, 0, D), F32)
    q, k, v = cut(h.q_off, h.q_head, h.hq), cut(h.k_off, D, h.hkv), cut(h.v_off, D, h.hkv)
    if q_norm is not None:
        q = norm(q, q_norm, eps)
    if k_norm is not None:
        k = norm(k, k_norm, eps)
    table = dense.cos_sin(np, positions, rotary.inv_freq, rotary.factor)
    q = dense.rope(q, None, 0.0, rotary.rot, table=table)
    k = dense.rope(k, None, 0.0, rotary.rot, table=table)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def qk_prepare(be, src, heads: Heads, rotary: Rotary, pos, row_indptr, *, q_norm=None, k_norm=None, eps: float = 1e-6,
               inv_freq=None, q=None, k=None, v=None, dtype=np.float32, with_q: bool = True, with_v: bool = True):
    """q [rows, hq, D], k and v [rows, hkv, D] in `dtype` from projection rows src [rows, width] f32
    (heads' layout `heads`), q and k normed (q_norm / k_norm [D] f32, None: not normed) and rotated at
    each row's position. pos int32 [B], row_indptr int32 [B+1] (host or Staged). `inv_freq`: the
    rotary frequencies on the backend (default: uploaded from `rotary` per call). with_q / with_v
    False skip q / v (the drafter's context K|V has no q). Returns (q, k, v) (None where skipped)."""
    src, q_norm, k_norm, q, k, v = adopt(be, src=src, q_norm=q_norm, k_norm=k_norm, q=q, k=k, v=v,
                                         writes=("q", "k", "v"))
    require_ndim(src, 2, "src", "[rows, width]")
    require_dtype(src, F32, "src")
    rows, width = src.shape
    if width < heads.width or heads.D > MAX_DIM or heads.D % 2 or not 0 < rotary.rot <= heads.D or rotary.rot % 2:
        raise ShapeError(f"src has {width} columns and heads {heads}, rot {rotary.rot}: expected the heads inside a "
                         f"row, D even and at most {MAX_DIM}, rot even in (0, D]")
    suf = suffix(np.dtype(dtype), "dtype")
    host_indptr, dev_indptr = host_and_device(be, row_indptr, "row_indptr")
    require_indptr(host_indptr, "row_indptr", rows)
    B = host_indptr.shape[0] - 1
    host_pos, dev_pos = host_and_device(be, pos, "pos")
    require_shape(host_pos, (B,), "pos")
    require_dtype(host_pos, np.int32, "pos")
    for w, what in ((q_norm, "q_norm"), (k_norm, "k_norm")):
        if w is not None:
            require_shape(w, (heads.D,), what)
            require_dtype(w, F32, what)
    xp = be.xp
    outs = []
    for arr, what, n, want in ((q, "q", heads.hq, with_q), (k, "k", heads.hkv, True), (v, "v", heads.hkv, with_v)):
        if not want:
            outs.append(None)
            continue
        arr = xp.empty((rows, n, heads.D), dtype) if arr is None else arr
        require_shape(arr, (rows, n, heads.D), what)
        require_dtype(arr, dtype, what)
        outs.append(arr)
    q, k, v = outs
    if be.kernels is None:
        rq, rk, rv = qk_prepare_ref(src, heads, rotary, row_positions(host_pos, host_indptr), q_norm, k_norm, eps, dtype,
                                    norm=numpy_rmsnorm)
        for arr, ref in ((q, rq), (k, rk), (v, rv)):
            if arr is not None:
                arr[...] = ref
        return q, k, v
    if rows:
        inv = xp.asarray(rotary.inv_freq) if inv_freq is None else inv_freq
        slots = heads.hq + 2 * heads.hkv
        be.kernels.get_function(f"qk_prepare_{suf}")(
            (rows, -(-slots // WARPS)), (32 * WARPS,),
            (xp.ascontiguousarray(src), np.int64(width), np.int32(rows), np.int32(heads.hq), np.int32(heads.hkv),
             np.int32(heads.D), np.int32(heads.q_off), np.int32(heads.q_head), np.int32(heads.k_off),
             np.int32(heads.v_off), q_norm, k_norm, F32(eps), inv, np.int32(rotary.rot), F32(rotary.factor), dev_pos,
             dev_indptr, np.int32(B), q, k, v))
    return q, k, v
