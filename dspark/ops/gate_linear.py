"""An attention's output projection over its output and gates: out f32 [rows, N] = attn_gate(o, gates)
@ w, the gate taken into the tensor-core GEMM's activation stage (kernels: csrc/linear_mma.cuh's GATED
mode, `linear_mma_<dt>_gated_m<BM>`).

Every path gives the bits of `activation.attn_gate` then `linear.linear` over its output (the kernel
tests compare the two bitwise on simt):

* 16-bit weights and o of the same type, a plan whose CTAs stage f32 activations (decode, verify and
  batched rows: all but a prompt's): one launch. Each CTA reads o as stored and its gates where it read
  the activations, and multiplies them where it rounds them to the weights' type; the f32 copy of o is
  never written.
* A prompt's a16 tiles (activations rounded once, copied by cp.async) over o of the weights' type and
  heads of D % 4 == 0: `round_gate_<dt>` writes the rounded activations from o and its gates (no f32 o),
  then the a16 entry: two launches where there were three.
* o f32 without gates: `linear` over o itself.
* Anything else (FP8 or f32 weights, o of another type, the numpy backend): `attn_gate` into the
  workspace, then `linear`.
"""

from __future__ import annotations

import numpy as np

from ..arrays import adopt
from ..dtypes import suffix
from .activation import attn_gate, gate_source
from .checks import require_weights_for
from .fp8 import Fp8Matrix
from . import rowsplit
from .linear import (ROUND_THREADS, STAGE_SHAPES, ColumnRuns, a16, launch_mma, linear, mma_plan, shared_limit,
                     tensor_cores)
from .workspace import buffer

F32 = np.float32
def _plan(be, o_dtype, w, rows: int, k: int, n: int, forced: dict):
    """The tensor-core plan of o [rows, K] of o_dtype against w [K, N] on `be` where o is of w's 16-bit
    type (the gated entries read o as the weights' type), else None."""
    if be.kernels is None or isinstance(w, ColumnRuns | Fp8Matrix) or w.dtype.itemsize != 2 \
            or np.dtype(o_dtype) != np.dtype(w.dtype) or not tensor_cores(be) or not rows or not n:
        return None
    return mma_plan(rows, k, n, limit=shared_limit(be), **forced)


def fused(be, o_dtype, w, rows: int, k: int, n: int, head_dim: int, **forced) -> str | None:
    """How attn_gate_linear runs o [rows, K] of o_dtype (heads of head_dim) against w [K, N] on `be`:
    "stage" (one launch, the gate in the activation stage), "round" (round_gate, then the a16 tiles)
    or None (attn_gate, then linear). `forced`: mma_plan's bm / split / wide."""
    p = _plan(be, o_dtype, w, rows, k, n, forced)
    return None if p is None else fusion(p, k, head_dim)


def fusion(p, k: int, head_dim: int) -> str | None:
    """Where a 16-bit output projection of K (heads of head_dim) by plan p (mma_plan's) takes the gate
    (`fused`'s answers): the a16 tiles' rounding (four columns a thread, never across a head), the
    activation stage of the shapes that have a gated entry, or nowhere."""
    if a16(p, k):
        return "round" if head_dim % 4 == 0 else None
    return "stage" if p.shape in STAGE_SHAPES else None


def attn_gate_linear(be, o, w, gates=None, out=None, *, bm: int | None = None, split: bool | None = None,
                     wide: bool | None = None, ws=None):
    """attn_gate(o, gates) @ w: o [rows, heads, D] (f32/f16/bf16), gates as attn_gate takes them (None: o
    widened alone), w [heads * D, N] (any weight `linear` takes) -> f32 [rows, N]; bitwise
    `linear(be, attn_gate(be, o, gates), w)`. `bm`, `split`, `wide`, `ws`: linear's."""
    forced = {"bm": bm, "split": split, "wide": wide}
    o, out = adopt(be, o=o, out=out, writes=("out",))
    src, first, stride = gate_source(be, o, gates)
    rows, heads, D = o.shape
    k = heads * D
    if be.kernels is not None and not isinstance(w, ColumnRuns | Fp8Matrix):
        w = adopt(be, w=w)
    plan = {} if be.kernels is None else forced
    if src is None and o.dtype == F32:   # nothing to gate or widen
        return linear(be, o.reshape(rows, k), w, out=out, ws=ws, **plan)
    n = require_weights_for(w, k, rows, out, f"o of shape {tuple(o.shape)} (heads * D rows)")
    p = _plan(be, o.dtype, w, rows, k, n, forced)
    how = None if p is None else fusion(p, k, D)
    if how is None:
        o32 = attn_gate(be, o, None if src is None else (src, first, stride),
                        out=buffer(be, ws, f"attn.o32.{k}", rows, (k,)))
        return linear(be, o32, w, out=out, ws=ws, **plan)
    xp = be.xp
    o, w = xp.ascontiguousarray(o), xp.ascontiguousarray(w)
    out = xp.empty((rows, n), F32) if out is None else out
    gate = None if src is None else xp.ascontiguousarray(src).reshape(-1)[first:]
    gate_stride = np.int64(0 if src is None else src.shape[1])
    suf = suffix(w.dtype, "w")
    if how == "stage":
        launch_mma(be, f"linear_mma_{suf}_gated", p, o.reshape(rows, k), (w,), out, ws,
                   extra=(gate, gate_stride, np.int32(stride), np.int32(D)))
        return out
    xh = buffer(be, ws, f"linear.x16.{suf}.{k}", rows, (k,), w.dtype)
    rowsplit.launch(be, f"round_gate_{suf}", -(-rows * k // (4 * ROUND_THREADS)), ROUND_THREADS,
                    (o, gate, np.int32(rows), np.int32(heads), np.int32(D), gate_stride, np.int32(stride), xh))
    launch_mma(be, f"linear_mma_{suf}_a16", p, xh, (w,), out, ws)
    return out
