"""An MLP's down product over its gate|up product: out f32 [rows, N] = SwiGLU(gate_up) @ w, the SwiGLU
taken into the tensor-core GEMM's activation stage (kernels: csrc/linear_mma.cuh's SWIGLU mode,
`linear_mma_<dt>_swiglu_m<BM>` and `linear_fp8_<dt>_swiglu_m<BM>`; `round_swiglu_<dt>` in csrc/linear.cu
before a prompt's tiles).

Every path gives the bits of `activation.swiglu` then `linear.linear` over its output, so the fusion
is a launch plan, not a new order (the kernel tests compare the two bitwise on simt):

* 16-bit weights, a plan whose CTAs stage f32 activations (decode, verify and batched rows: all but a
  prompt's): one launch. Each CTA reads both halves of gate_up where it read the activations and
  combines them where it rounds them to the weights' type; the f32 activations are never written.
* 16-bit weights, a prompt's plan (linear.a16: the activations rounded once, copied into the tiles):
  `round_swiglu_<dt>` writes the rounded activations from gate_up, then the a16 entry: two launches
  where there were three, and no f32 activations written and read back.
* FP8 weights (W8A16): the stage as above, in the decode shapes' stream (16 and 32 rows) and the
  128-row tiles; not at 64 rows, where the held gate|up would cost the tile its second CTA per SM.
* Anything else (f32 weights, a ColumnRuns, the wide f32 tile, the numpy backend): `swiglu` into the
  workspace, then `linear`.
"""

from __future__ import annotations

import numpy as np

from ..arrays import adopt
from ..dtypes import suffix
from . import rowsplit
from .activation import gate_up_width, swiglu
from .checks import require_dtype, require_shape, require_weights_for
from .fp8 import Fp8Matrix, scale_grid
from .linear import (ROUND_THREADS, STAGE_SHAPES, ColumnRuns, MmaPlan, a16, fp8_plan, launch_mma, linear, mma_plan, shared_limit,
                     tensor_cores)
from .workspace import buffer

F32 = np.float32
FP8_FUSED_SHAPES = ("m16", "m32", "m128")      # linear_fp8_<dt>_swiglu_<shape>: linear_fp8.cu's


def _plan(be, w, rows: int, k: int, n: int, forced: dict) -> MmaPlan | None:
    """The tensor-core plan the product of w [K, N] would launch on `be` (fp8_plan's for FP8 weights),
    or None where it runs no tensor-core GEMM (the numpy backend, f32 weights, a ColumnRuns)."""
    if be.kernels is None or isinstance(w, ColumnRuns) or not tensor_cores(be) or not rows or not n:
        return None
    if isinstance(w, Fp8Matrix):
        return fp8_plan(rows, k, n, **_fp8_forced(forced)) if np.dtype(w.compute).itemsize == 2 else None
    return mma_plan(rows, k, n, limit=shared_limit(be), **forced) if w.dtype.itemsize == 2 else None


def fused(be, w, rows: int, k: int, n: int, **forced) -> str | None:
    """How swiglu_linear runs gate_up [rows, 2K] against w [K, N] on backend `be`: "stage" (one launch,
    SwiGLU in the activation stage), "round" (round_swiglu, then the a16 tiles) or None (swiglu, then
    linear). `forced`: mma_plan's bm / split / wide."""
    p = _plan(be, w, rows, k, n, forced)
    return None if p is None else fusion(p, k, fp8=isinstance(w, Fp8Matrix))


def fusion(p: MmaPlan, k: int, fp8: bool = False) -> str | None:
    """Where a down product of K by plan p (mma_plan's; fp8_plan's for FP8 weights) takes the SwiGLU
    (`fused`'s answers): the a16 tiles' rounding, the activation stage of the shapes that have a SwiGLU
    entry, or nowhere."""
    if fp8:
        return "stage" if p.shape in FP8_FUSED_SHAPES else None
    if a16(p, k):
        return "round"
    return "stage" if p.shape in STAGE_SHAPES else None


def _fp8_forced(forced: dict) -> dict:
    """mma_plan's forced shape and mode as fp8_plan takes them (it has no wide tile)."""
    return {key: v for key, v in forced.items() if key != "wide"}


def swiglu_linear(be, gate_up, w, out=None, *, bm: int | None = None, split: bool | None = None,
                  wide: bool | None = None, ws=None):
    """SwiGLU(gate_up) @ w: gate_up [rows, 2K] f32 = [gate | up], w [K, N] (any weight `linear` takes)
    -> f32 [rows, N]; bitwise `linear(be, swiglu(be, gate_up), w)`. `bm`, `split`, `wide`, `ws`:
    linear's."""
    forced = {"bm": bm, "split": split, "wide": wide}
    gate_up, out = adopt(be, gate_up=gate_up, out=out, writes=("out",))
    rows, k = gate_up.shape[0] if gate_up.ndim else 0, gate_up_width(gate_up)
    n = require_weights_for(w, k, rows, out, f"gate_up of shape {tuple(gate_up.shape)} (half its columns)")
    if be.kernels is not None and not isinstance(w, ColumnRuns | Fp8Matrix):
        w = adopt(be, w=w)
    if isinstance(w, Fp8Matrix):   # linear_fp8's checks, before anything runs
        require_dtype(w.q, np.uint8, "w.q")
        require_dtype(w.scale, F32, "w.scale")
        require_shape(w.scale, scale_grid(k, n), "w.scale")
    p = _plan(be, w, rows, k, n, forced)
    how = None if p is None else fusion(p, k, fp8=isinstance(w, Fp8Matrix))
    if how is None:
        act = swiglu(be, gate_up, out=buffer(be, ws, f"mlp.act.{k}", rows, (k,)))
        return linear(be, act, w, out=out, ws=ws, **({} if be.kernels is None else forced))
    xp = be.xp
    gate_up = xp.ascontiguousarray(gate_up)
    out = xp.empty((rows, n), F32) if out is None else out
    if isinstance(w, Fp8Matrix):
        q, scale = adopt(be, q=w.q, scale=w.scale)
        launch_mma(be, f"linear_fp8_{suffix(w.compute, 'w.compute')}_swiglu", p, gate_up,
                   (xp.ascontiguousarray(q), xp.ascontiguousarray(scale)), out, ws, k=k)
        return out
    w = xp.ascontiguousarray(w)
    suf = suffix(w.dtype, "w")
    if how == "stage":
        launch_mma(be, f"linear_mma_{suf}_swiglu", p, gate_up, (w,), out, ws, k=k)
    else:
        xh = buffer(be, ws, f"linear.x16.{suf}.{k}", rows, (k,), w.dtype)
        rowsplit.launch(be, f"round_swiglu_{suf}", -(-rows * k // (4 * ROUND_THREADS)), ROUND_THREADS,
                        (gate_up, np.int32(rows), np.int32(k), xh))
        launch_mma(be, f"linear_mma_{suf}_a16", p, xh, (w,), out, ws)
    return out
