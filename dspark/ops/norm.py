"""RMSNorm of rows, in one fixed order per row (kernel: csrc/norm.cu).

    y = x / sqrt(mean(x^2) + eps) * weight        over the last axis of x [..., n]

Row invariance (DESIGN section 3) needs each row's sum of squares taken in an order that depends
on n alone. NumPy's reduction over a contiguous last axis is pairwise per row, so the numpy
backend keeps its one-line formula (`rmsnorm_numpy`), run natively by dspark.ops.host.rmsnorm
with the same bits. CuPy's reductions choose their block layout
from the array's shape, so on a GPU a row's order could change with the number of rows: the simt
and cuda backends run `rmsnorm_f32`, one warp per row, lane l summing x[l]^2, x[l+32]^2, ... and an
xor butterfly. `rmsnorm_ref` is its NumPy twin, bit for bit (the kernel tests compare them with
array_equal); it and the numpy formula agree within a few ulp.
"""

from __future__ import annotations

import numpy as np

from ..arrays import adopt
from . import host
from .checks import require_dtype, require_shape

F32 = np.float32
WARPS = 8   # rows per CTA (kNormWarps)


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


def rmsnorm(be, x, weight, eps: float, out=None):
    """RMSNorm of x [..., n] (f32) with weight [n] (f32) over the last axis -> f32 like x."""
    x, weight, out = adopt(be, x=x, weight=weight, out=out, writes=("out",))
    require_dtype(x, F32, "x")
    n = x.shape[-1] if x.ndim else 0
    require_shape(weight, (n,), "weight")
    require_dtype(weight, F32, "weight")
    if be.kernels is None:
        y = host.rmsnorm(x, weight, eps) if host.NATIVE else rmsnorm_numpy(x, weight, eps)  # the same bits
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
