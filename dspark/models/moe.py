"""The sparse mixture-of-experts FFN: one more FFN kind of the one trunk, chosen per layer by
TrunkConfig.ffn (Qwen3.5-MoE: every layer; Qwen3-MoE: by decoder_sparse_step and mlp_only_layers).

A MoE layer's FFN, on the post-attention norm's output h [rows, d]:

    logits  = h @ router                                  [rows, E] (the shared expert's gate beside it)
    routing = top-k of softmax(logits), ties to the lower expert, weights renormalized over the k
              where the model does (expert_renorm)
    y_e     = SwiGLU expert e on the rows routed to it    (grouped: each expert's weights read once)
    out     = sum of w_e y_e over the row's experts, in increasing expert id
              + sigmoid(h @ shared_gate) * SwiGLU_shared(h)      (where the model has a shared expert)

dspark.ops.moe holds the router, the grouped products and the combine. Every op is row-invariant,
so a row's output is the same bits alone, in any batch, in a verify column or a decode step.

Weights (our names, inside layer i): `moe.router` [d, E]; per expert e `moe.experts.{e}.w_gate`,
`.w_up` [d, I] and `.w_down` [I, d]; the shared expert `moe.shared.w_gate`, `.w_up` [d, Is],
`.w_down` [Is, d] and `moe.shared_gate` [d, 1]. On the backend each layer's experts are stacked
(`stacks`): `moe.w_gate_up` [E, d, 2I] (each expert's [gate | up], as dspark.models.weights fuses
a dense MLP's) and `moe.w_down` [E, I, d], every per-expert name a view of its slice; the router and
the shared gate are one GEMM (`moe.w_route`, weights.FUSED), as are the shared expert's gate and up.

FP8 experts (an FP8 checkpoint's quantized experts: dspark.ops.fp8) stack the same way, as e4m3
bytes and block scales (`Fp8Stack`: q [E, K, N], scale [E, ceil(K / 128), ceil(N / 128)]), every
per-expert name an Fp8Matrix view of its expert's bytes and scales; no dequantized copy is made. A
[gate | up] stack of FP8 parts is one scale grid only when the gate's width is whole 128-column
blocks (dspark.models.hf.moe refuses the others at load).
"""

from __future__ import annotations

import time

import numpy as np

from .. import profile
from ..errors import DTypeError
from ..ops.fp8 import Fp8Matrix, Fp8Stack
from ..ops.linear import linear
from ..ops.moe import KERNEL_DTYPES, combine, grouped_linear, grouped_plan, route
from ..ops.swiglu_linear import swiglu_linear
from .config import TrunkConfig

EXPERT_PARTS = ("w_gate", "w_up", "w_down")


def moe_spec(c: TrunkConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Our tensors of one MoE layer (prefix p = "layers.{i}.") and their shapes."""
    d, E, I, Is = c.d_model, c.experts, c.expert_hidden, c.shared_expert_hidden
    spec = {p + "moe.router": (d, E)}
    for e in range(E):
        q = f"{p}moe.experts.{e}."
        spec.update({q + "w_gate": (d, I), q + "w_up": (d, I), q + "w_down": (I, d)})
    if Is:
        spec.update({p + "moe.shared.w_gate": (d, Is), p + "moe.shared.w_up": (d, Is), p + "moe.shared.w_down": (Is, d),
                     p + "moe.shared_gate": (d, 1)})
    return spec


def stacks(names) -> dict[str, list[tuple[str, ...]]]:
    """Stacked name -> per expert, in increasing e, the tensors side by side in its slice: for every
    MoE layer among `names`, `moe.w_gate_up` (w_gate, w_up) and `moe.w_down` (w_down)."""
    experts: dict[str, int] = {}
    for name in names:
        head, sep, rest = name.partition(".moe.experts.")
        if sep:
            e = int(rest.split(".", 1)[0])
            experts[head] = max(experts.get(head, -1), e)
    out = {}
    for head, last in experts.items():
        q = [f"{head}.moe.experts.{e}." for e in range(last + 1)]
        out[f"{head}.moe.w_gate_up"] = [(x + "w_gate", x + "w_up") for x in q]
        out[f"{head}.moe.w_down"] = [(x + "w_down",) for x in q]
    return out


def stacked_layout(be, groups: dict, shapes: dict, make, done, owned: list) -> dict:
    """name -> backend array for the stacked experts: one [E, K, sum of widths] array per stack, or
    an Fp8Stack where the experts are FP8 (`make(parts)` gives one expert's slice on the backend,
    an array or an Fp8Matrix, one at a time: a checkpoint is never held whole), owned by 'weights'
    (each allocation appended to `owned` as it is made), and every per-expert tensor a view of its
    columns. A stack's experts are all FP8 or all not (dspark.models.hf.moe checks it at load)."""
    out = {}
    for name, per_expert in groups.items():
        first = make(per_expert[0])
        fp8 = isinstance(first, Fp8Matrix)
        E = len(per_expert)

        def alloc(like):
            owned.append(be.alloc.adopt(be.xp.empty((E, *like.shape), like.dtype), "weights"))
            return owned[-1]
        dev = Fp8Stack(alloc(first.q), alloc(first.scale), first.compute) if fp8 else alloc(first)
        for e, parts in enumerate(per_expert):
            m = first if e == 0 else make(parts)
            if isinstance(m, Fp8Matrix) != fp8:
                raise DTypeError(f"tensor {parts[0]!r}: a stack's experts are all FP8 or all 16-bit")
            if fp8:
                dev.q[e], dev.scale[e] = m.q, m.scale
            else:
                dev[e] = m
            at = 0
            for q in parts:
                width = shapes[q][1]
                out[q] = dev[e].columns(at, width) if fp8 else dev[e, :, at : at + width]
                at += width
                done(q)
        out[name] = dev
    return out


def require_expert_storage(be, dtype) -> None:
    """The experts' storage dtype on `be`: any on numpy; float32 or bfloat16 on the kernel backends
    (the grouped product's entries, csrc/moe.cu). Refused before anything is uploaded."""
    if be.kernels is not None and np.dtype(dtype) not in KERNEL_DTYPES:
        raise DTypeError(f"dtype={np.dtype(dtype)}: a mixture-of-experts trunk on {be.name!r} stores its matrices as "
                         f"float32 or bfloat16 (the grouped expert product's kernels)")


def moe_ffn(trunk, h, p: str, layer: int, ws):
    """The MoE FFN of layer `layer` (prefix p) on h [rows, d] -> [rows, d] (the workspace's
    "sublayer", what the residual add reads)."""
    c, w, be = trunk.config, trunk.w, trunk.be
    rows, d, E, k = h.shape[0], c.d_model, c.experts, c.expert_top_k
    shared = c.shared_expert_hidden
    router = w.get(p + "moe.w_route", w[p + "moe.router"])  # [router | shared gate] where both exist
    logits = linear(be, h, router, out=ws.take("moe.logits", rows, (router.shape[1],)), ws=ws)
    w_gate_up, w_down = w[p + "moe.w_gate_up"], w[p + "moe.w_down"]
    plan = grouped_plan(rows, k, E, d, w_gate_up.shape[2], np.dtype(w_gate_up.dtype).itemsize)
    r = route(be, logits, E, k, c.expert_renorm, plan.tile_rows, layer=layer, ws=ws)
    # The expert products' wall time, for the cost model (dspark.cost: what a distinct expert costs),
    # where a launch has run when it returns: the CPU backends.
    start = time.perf_counter() if be.name != "cuda" and profile.timing_experts() else None
    gate_up = grouped_linear(be, h, w_gate_up, r, gather=True, name="moe.gate_up", ws=ws)
    y = grouped_linear(be, gate_up, w_down, r, gather=False, swiglu=True, name="moe.down", ws=ws)
    if start is not None:
        profile.expert_seconds(time.perf_counter() - start)
    shared_y = gate = None
    if shared:
        sg = linear(be, h, w[p + "moe.shared.w_gate_up"], out=ws.take("moe.shared.gate_up", rows, (2 * shared,)), ws=ws)
        shared_y = swiglu_linear(be, sg, w[p + "moe.shared.w_down"], out=ws.take("moe.shared.y", rows, (d,)), ws=ws)
        gate = (logits, E)
    return combine(be, y, r, shared=shared_y, gate=gate, out=ws.take("sublayer", rows, (d,)))
