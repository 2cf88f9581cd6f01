"""Row-invariant model glue: RoPE, SwiGLU, sigmoid, a shape-independent sum, exact widening.

These run as array ops on the backend's array module (NumPy, or CuPy on `cuda`). Each is written
so that a row's result never depends on how many rows share the call (DESIGN section 3):

* The GEMM: dspark.ops.linear (a kernel reading the weights as stored, f32/f16/bf16, in one fixed
  order per output on simt and cuda; fixed-shape BLAS chunks on numpy). Projections of one layer
  input are fused along N (dspark.models.weights.FUSED): one GEMM per input.
* Norms: dspark.ops.norm (a kernel with one fixed order per row on simt and cuda). Any other sum
  over an axis of per-row data uses `halving_sum`.
"""

from __future__ import annotations

import math

import numpy as np

from ..backends import array_module as _xp
from ..dtypes import BF16


def widen(w):
    """f32 view or exact f32 copy of an f32 / f16 / bf16 array (bf16: the 16 bits shifted into
    the high half of an f32, which is what a bf16 value is, on NumPy and CuPy alike)."""
    if w.dtype == np.float32:
        return w
    if w.dtype == BF16:
        return (w.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return w.astype(np.float32)


def halving_sum(x):
    """Sum over the last axis by halving: zero-pad it to a power of two, then x[..., :h] +
    x[..., h:] until one is left. Elementwise adds only, so a row's order is a function of the
    axis length alone on every array library (a library's own reduction may pick its order from
    the whole array's shape)."""
    xp = _xp(x)
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = xp.concatenate([x, xp.zeros(x.shape[:-1] + (width - n,), x.dtype)], axis=-1)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def rope_frequencies(dim: int, theta: float, scaling: tuple = ()) -> tuple[np.ndarray, float]:
    """(inverse frequencies f32 [dim/2], attention factor) of RoPE over `dim` rotated dims, as
    transformers computes them: rope_type default, linear (positions / factor) or yarn (NTK-by-parts
    blend of interpolated and extrapolated frequencies; cos and sin scaled by the attention factor).
    Worked out in f64 and rounded once, so the table is the same on every backend."""
    p = dict(scaling)
    kind = p.get("rope_type", "default")
    inv = 1.0 / (theta ** (np.arange(dim // 2, dtype=np.float64) * 2.0 / dim))
    factor = float(p.get("factor", 1.0))
    if kind == "default":
        return inv.astype(np.float32), 1.0
    if kind == "linear":
        return (inv / factor).astype(np.float32), 1.0
    if kind != "yarn":
        raise ValueError(f"rope_type={kind!r}: expected default, linear or yarn")

    def correction_dim(rotations):
        return dim * math.log(p["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    inv = inv / factor * (1 - extrapolate) + inv * extrapolate
    return inv.astype(np.float32), float(p["attention_factor"] if p.get("attention_factor") is not None
                                         else yarn_mscale(factor, p.get("mscale"), p.get("mscale_all_dim")))


def yarn_mscale(factor: float, mscale=None, mscale_all_dim=None) -> float:
    """YaRN's default attention factor (transformers' get_mscale)."""
    def get(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    return float(get(factor, mscale) / get(factor, mscale_all_dim)) if mscale and mscale_all_dim else get(factor)


_INV_FREQ: dict = {}  # (array module, dim, theta, scaling) -> (f64 inverse frequencies on it, attention factor)


def rope_table(xp, positions, theta: float, rotary_dim: int, scaling: tuple = ()):
    """(cos, sin) [rows, 1, rotary_dim / 2] f32 for positions int [rows] (host or device): compute
    once per pass, share across layers (`rope(..., table=)`). The frequencies are uploaded once
    per (dim, theta, scaling)."""
    key = (xp, rotary_dim, theta, scaling)
    if key not in _INV_FREQ:
        inv, factor = rope_frequencies(rotary_dim, theta, scaling)
        _INV_FREQ[key] = (xp.asarray(inv, dtype=np.float64), factor)
    return cos_sin(xp, positions, *_INV_FREQ[key])


def cos_sin(xp, positions, inv, attention_factor: float):
    """(cos, sin) [rows, 1, len(inv)] f32 of positions [rows] and inverse frequencies `inv`: angles
    in f64, cos and sin rounded once to f32 (identical per position whatever the batch), times the
    attention factor."""
    ang = xp.asarray(positions).astype(np.float64)[:, None] * xp.asarray(inv).astype(np.float64)[None, :]
    cos = xp.cos(ang).astype(np.float32)[:, None, :]
    sin = xp.sin(ang).astype(np.float32)[:, None, :]
    if attention_factor != 1.0:
        cos, sin = cos * np.float32(attention_factor), sin * np.float32(attention_factor)
    return cos, sin


def rope(x, positions, theta: float, rotary_dim: int | None = None, scaling: tuple = (), table=None):
    """Rotary embedding, rotate-half convention, over the first `rotary_dim` dims of each head
    (default: all; the rest pass through): x [rows, heads, D], positions int [rows]; `table`:
    rope_table's (cos, sin) for these positions, when the caller made it already."""
    xp = _xp(x)
    d = x.shape[-1] if rotary_dim is None else rotary_dim
    half = d // 2
    cos, sin = table if table is not None else rope_table(xp, positions, theta, d, scaling)
    x1, x2 = x[..., :half], x[..., half:d]
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    return xp.concatenate(rotated + ([x[..., d:]] if d < x.shape[-1] else []), axis=-1)


def sigmoid(x):
    xp = _xp(x)
    return np.float32(1.0) / (np.float32(1.0) + xp.exp(-x))


def silu(x):
    return x * sigmoid(x)


def swiglu(gate, up):
    return silu(gate) * up
