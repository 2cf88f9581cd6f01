"""The layers' gates, elementwise (kernels: csrc/activation.cu): SwiGLU of the MLP, the attention
output gate (with the widening of a 16-bit attention output) and the confidence head's sigmoid.

Each was two to four array operations of glue, a launch and an output allocation each; here each
is one launch into a given output. The NumPy functions are the numpy backend's implementation and
the kernels' oracle: the same f32 operations in the same order (dspark.ops.dense's formulas), so
they agree up to the last bit of exp (the host's libm against the device's expf).
"""

from __future__ import annotations

import numpy as np

from ..arrays import adopt
from ..dtypes import suffix, to_f32
from ..errors import ShapeError
from . import dense
from .checks import require_dtype, require_ndim, require_shape

F32 = np.float32
THREADS = 256  # kActThreads


def _grid(n: int) -> tuple[int]:
    return (-(-n // THREADS),)


def swiglu_ref(gate_up):
    """SiLU(gate) * up of gate_up [rows, 2F] -> [rows, F]."""
    F = gate_up.shape[1] // 2
    return dense.swiglu(gate_up[:, :F], gate_up[:, F:])


def swiglu(be, gate_up, out=None):
    """(g * sigmoid(g)) * u for gate_up [rows, 2F] f32 = [g | u] -> out [rows, F] f32."""
    gate_up, out = adopt(be, gate_up=gate_up, out=out, writes=("out",))
    require_ndim(gate_up, 2, "gate_up", "[rows, 2F]")
    require_dtype(gate_up, F32, "gate_up")
    rows, two_f = gate_up.shape
    if two_f % 2:
        raise ShapeError(f"gate_up has {two_f} columns: expected an even number, [gate | up]")
    F = two_f // 2
    out = be.xp.empty((rows, F), F32) if out is None else out
    require_shape(out, (rows, F), "out")
    require_dtype(out, F32, "out")
    if be.kernels is None:
        out[...] = swiglu_ref(gate_up)
    elif rows * F:
        be.kernels.get_function("swiglu_f32")(_grid(rows * F), (THREADS,),
                                               (be.xp.ascontiguousarray(gate_up), np.int32(rows), np.int32(F), out))
    return out


def attn_gate_ref(o, gate):
    """widen(o) [rows, heads, D] times sigmoid(gate) [rows, heads, D] (None: no gate), f32."""
    o = to_f32(o)
    return o if gate is None else o * dense.sigmoid(np.asarray(gate, F32))


def attn_gate(be, o, gate=None, out=None):
    """o [rows, heads, D] (f32/f16/bf16) widened to f32, times sigmoid(gate) where the model gates
    its attention output: gate [rows, heads, D] f32, any row and head strides with unit stride in D
    (a view of the q projection: Qwen3.5's gate follows each head's query) -> out [rows, heads * D] f32."""
    o, gate, out = adopt(be, o=o, gate=gate, out=out, writes=("out",))
    require_ndim(o, 3, "o", "[rows, heads, D]")
    suf = suffix(o.dtype, "o")
    rows, heads, D = o.shape
    out = be.xp.empty((rows, heads * D), F32) if out is None else out
    require_shape(out, (rows, heads * D), "out")
    require_dtype(out, F32, "out")
    if gate is not None:
        require_shape(gate, (rows, heads, D), "gate")
        require_dtype(gate, F32, "gate")
        if gate.strides[2] != 4:
            raise ShapeError("gate: expected unit stride along D")
    if be.kernels is None:
        out[...] = attn_gate_ref(o, gate).reshape(rows, heads * D)
        return out
    if not rows * heads * D:
        return out
    g_ptr, g_row, g_head = None, np.int64(0), np.int32(0)
    if gate is not None:  # the kernel walks it from its first element by its strides
        g_row, g_head = np.int64(gate.strides[0] // 4), np.int32(gate.strides[1] // 4)
        g_ptr = _from_first(be, gate, (rows - 1) * int(g_row) + (heads - 1) * int(g_head) + D)
    be.kernels.get_function(f"attn_gate_{suf}")(_grid(rows * heads * D), (THREADS,),
                                                (be.xp.ascontiguousarray(o), g_ptr, np.int32(rows), np.int32(heads),
                                                 np.int32(D), g_row, g_head, out))
    return out


def _from_first(be, view, span: int):
    """A 1-D C-contiguous array over the `span` elements from `view`'s first element (a strided
    view's memory, as a kernel that walks it by its strides reads it)."""
    base = view
    while base.base is not None:
        base = base.base
    if not base.flags.c_contiguous:
        raise ShapeError("gate: expected a view of a C-contiguous array")
    start = (be.address(view) - be.address(base)) // base.dtype.itemsize
    flat = base.reshape(-1)
    if start + span > flat.shape[0]:
        raise ShapeError("gate: its strides reach past the array it views")
    return flat[start : start + span]


def sigmoid_bias(be, x, bias, out=None):
    """1 / (1 + exp(-(x + bias[0]))) for x [n] f32 and bias [1] f32 -> out [n] f32."""
    x, bias, out = adopt(be, x=x, bias=bias, out=out, writes=("out",))
    require_ndim(x, 1, "x", "[n]")
    require_dtype(x, F32, "x")
    require_shape(bias, (1,), "bias")
    require_dtype(bias, F32, "bias")
    n = x.shape[0]
    out = be.xp.empty(n, F32) if out is None else out
    require_shape(out, (n,), "out")
    require_dtype(out, F32, "out")
    if be.kernels is None:
        out[...] = dense.sigmoid(x + bias[0])
    elif n:
        be.kernels.get_function("sigmoid_bias_f32")(_grid(n), (THREADS,), (be.xp.ascontiguousarray(x), bias,
                                                                           np.int32(n), out))
    return out
