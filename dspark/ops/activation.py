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


def gate_up_width(gate_up) -> int:
    """F of gate_up [rows, 2F] f32 = [gate | up], after its checks."""
    require_ndim(gate_up, 2, "gate_up", "[rows, 2F]")
    require_dtype(gate_up, F32, "gate_up")
    if gate_up.shape[1] % 2:
        raise ShapeError(f"gate_up has {gate_up.shape[1]} columns: expected an even number, [gate | up]")
    return gate_up.shape[1] // 2


def swiglu(be, gate_up, out=None):
    """(g * sigmoid(g)) * u for gate_up [rows, 2F] f32 = [g | u] -> out [rows, F] f32."""
    gate_up, out = adopt(be, gate_up=gate_up, out=out, writes=("out",))
    rows, F = gate_up.shape[0] if gate_up.ndim else 0, gate_up_width(gate_up)
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


def gates_of(src, first: int, head_stride: int, heads: int, D: int):
    """The gate [rows, heads, D] that attn_gate reads from src [rows, width]: head h at columns
    first + h * head_stride .. + D (NumPy, for the reference)."""
    return np.stack([np.asarray(src)[:, first + h * head_stride : first + h * head_stride + D] for h in range(heads)],
                    axis=1)


def gate_source(be, o, gates):
    """(src, first column, head stride) of attn_gate's `gates` for o [rows, heads, D] (src None: no
    gate), after the checks of both."""
    require_ndim(o, 3, "o", "[rows, heads, D]")
    suffix(o.dtype, "o")
    rows, heads, D = o.shape
    src, first, stride = (None, 0, 0) if gates is None else gates
    if src is not None:
        src = adopt(be, gates=src)
        require_ndim(src, 2, "gates", "[rows, width]")
        require_dtype(src, F32, "gates")
        if src.shape[0] != rows or first < 0 or stride < D or first + (heads - 1) * stride + D > src.shape[1]:
            raise ShapeError(f"gates has shape {tuple(src.shape)}: expected {rows} rows holding {heads} heads of {D} "
                             f"from column {first}, every {stride}")
    return src, first, stride


def attn_gate(be, o, gates=None, out=None):
    """o [rows, heads, D] (f32/f16/bf16) widened to f32, times sigmoid(gate) where the model gates
    its attention output -> out [rows, heads * D] f32. gates = (src [rows, width] f32, first
    column, head stride): head h's gate is src[:, first + h * head_stride :][:, :D] (Qwen3.5's gate
    follows each head's query in the q projection: first D, stride 2 D); None: no gate."""
    o, out = adopt(be, o=o, out=out, writes=("out",))
    src, first, stride = gate_source(be, o, gates)
    suf = suffix(o.dtype, "o")
    rows, heads, D = o.shape
    out = be.xp.empty((rows, heads * D), F32) if out is None else out
    require_shape(out, (rows, heads * D), "out")
    require_dtype(out, F32, "out")
    if be.kernels is None:
        gate = None if src is None else gates_of(src, first, stride, heads, D)
        out[...] = attn_gate_ref(o, gate).reshape(rows, heads * D)
        return out
    if rows * heads * D:
        be.kernels.get_function(f"attn_gate_{suf}")(
            _grid(rows * heads * D), (THREADS,),
            (be.xp.ascontiguousarray(o), None if src is None else be.xp.ascontiguousarray(src).reshape(-1)[first:],
             np.int32(rows), np.int32(heads), np.int32(D), np.int64(0 if src is None else src.shape[1]),
             np.int32(stride), out))
    return out


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
