"""Row-invariant model glue: GEMM, RMSNorm, RoPE, SwiGLU, sigmoid/softplus, L2 norm.

These run as array ops on the backend's array module (NumPy, or CuPy on `cuda`). Each is written
so that a row's result never depends on how many rows share the call (DESIGN section 3):

* `linear` multiplies in fixed-shape chunks of ROW_CHUNK rows (zero-padded). BLAS picks its
  algorithm, and so its reduction order, by shape (a 1-row product is a GEMV), so a plain
  `x @ W` over a batch is not row-invariant; a fixed [ROW_CHUNK, K] x [K, N] product is.
* Norms reduce one row over its last, contiguous axis, so every row takes the same pairwise order.
"""

from __future__ import annotations

import numpy as np

from ..backends import array_module as _xp

ROW_CHUNK = 8


def linear(x, w):
    """x [rows, K] @ w [K, N] in fixed chunks of ROW_CHUNK rows, f32."""
    xp = _xp(x)
    rows, k = x.shape
    out = xp.empty((rows, w.shape[1]), dtype=np.float32)
    if rows == 0:
        return out
    full = rows - rows % ROW_CHUNK
    for r in range(0, full, ROW_CHUNK):
        out[r : r + ROW_CHUNK] = x[r : r + ROW_CHUNK] @ w
    if full < rows:
        pad = xp.zeros((ROW_CHUNK, k), dtype=x.dtype)
        pad[: rows - full] = x[full:]
        out[full:] = (pad @ w)[: rows - full]
    return out


def rmsnorm(x, weight, eps: float):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    xp = _xp(x)
    ms = xp.mean(x * x, axis=-1, keepdims=True)
    return (x / xp.sqrt(ms + np.float32(eps))) * weight


def rope(x, positions, theta: float):
    """Rotary embedding, rotate-half convention: x [rows, heads, D], positions int [rows]."""
    xp = _xp(x)
    d = x.shape[-1]
    half = d // 2
    inv = (1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2.0 / d))).astype(np.float32)
    # Angles in f64, then f32 cos/sin: identical per position whatever the batch.
    ang = xp.asarray(positions, dtype=np.float64)[:, None] * xp.asarray(inv, dtype=np.float64)[None, :]
    cos = xp.cos(ang).astype(np.float32)[:, None, :]
    sin = xp.sin(ang).astype(np.float32)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def sigmoid(x):
    xp = _xp(x)
    return np.float32(1.0) / (np.float32(1.0) + xp.exp(-x))


def silu(x):
    return x * sigmoid(x)


def swiglu(gate, up):
    return silu(gate) * up
