"""A sparse mixture-of-experts block's ops (kernels: csrc/moe.cu): the router, the grouped expert
product and the combine, with their NumPy twins and the grouped product's launch plan.

* `route` (moe_route_f32): per row, softmax over the router's logits in f32, the top-k with ties to
  the LOWER expert index, the weights (renormalized over the k where the model does), the row's k
  entries in increasing expert id; then the rows grouped by expert in increasing row order and the
  CTA-to-expert map of the grouped products (`Routing`). No capacity limit, no dropped rows.
  `route_ref` and `group_ref` are its twins: the ids and the grouping exactly, the weights up to the
  last bit of exp (the host's libm against the device's expf).
* `grouped_linear` (moe_linear_f32, moe_linear_mma_bf16_m<BM>, moe_linear_fp8_bf16_m<BM>): grouped
  row g of expert e is x[src[g]] @ w[e] (`gather`) or x[g] @ w[e]. Each CTA takes one item of the
  map (an expert's tile of rows) and runs dspark's GEMM tile on it (csrc/linear_f32.cuh,
  csrc/linear_mma.cuh, csrc/linear_fp8.cuh), K ordered by (K, N) alone: a row's expert output is
  bitwise the product (dspark.ops.linear) of that row by that expert's weights, alone or sharing
  the expert. Each distinct expert's weights are read once per tile of its rows: a verify of w rows
  reads the union of their experts once. FP8 experts (dspark.ops.fp8.Fp8Stack: e4m3 bytes and
  128 x 128 block scales per expert) dequantize in registers exactly as linear_fp8 does, with its K
  chunk (a multiple of the scale block): a row's expert output is bitwise linear_fp8 of the row by
  that expert's matrix; `grouped_linear_ref` is the twin. With `swiglu` the down product reads
  the grouped rows' gate|up and takes SiLU(gate) * up in the tile's activation stage
  (moe_linear_<kind>_bf16_swiglu_m16, csrc/linear_mma.cuh's SWIGLU mode): bitwise swiglu_f32 then
  the product, one launch fewer (f32 experts, a prompt's 128-row tiles and numpy keep the two steps).
* `combine` (moe_combine_f32): a row's k outputs weighted and added in increasing expert id from 0
  (fixed by the row alone), then the shared expert times the sigmoid of its gate where the model has
  one. `combine_ref` is its twin, bit for bit without the shared gate's exp.

Every launch is sized on the host by the worst case (`grouped_plan`, `max_items`: from rows, k and
the expert count, never from the routing) and reads the routing's counts on the device, so a pass
of MoE layers records and captures into a CUDA graph with no host sync. The router reports the
distinct experts each pass read to dspark.profile (`profile.experts`), the count the cost of a
verify follows.

On numpy (the CPU product) the router is the twin and the grouped product is one call of the
native product (dspark.ops.product; product_fp8 on the e4m3 bytes for FP8 experts) per expert over
that expert's rows: the same row invariance, the same combine order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import profile
from ..arrays import adopt
from ..dtypes import BF16, suffix
from ..errors import DTypeError, ShapeError
from . import dense, product, rowsplit
from .activation import gate_up_width
from .activation import swiglu as swiglu_op
from .checks import require_dtype, require_ndim, require_shape
from .fp8 import BLOCK as FP8_BLOCK, Fp8Stack, scale_grid
from .linear import FP8_ALIGN, MMA_CONFIGS, MMA_TARGET_CTAS, ROW_TILE, THREADS as LINEAR_THREADS, \
    _require_tensor_cores, linear_fp8_ref, mma_shared_mem, mma_split_plan, split_plan, tiles

F32 = np.float32
ROUTE_WARPS = 8                  # kMoeWarps: router rows per CTA, a warp each
ROUTE_THREADS = 32 * ROUTE_WARPS
COMBINE_THREADS = 256            # kMoeCombineThreads
MAX_EXPERTS = 512                # kMoeMaxExperts: 16 per lane of the router's warp
MAX_TOP_K = 32                   # a lane of the router's warp per chosen expert
MMA_TILES = (16, 128)            # the grouped product's tensor-core row tiles (moe.cu's entries)
KERNEL_DTYPES = (np.dtype(F32), BF16)  # the grouped product's weights on the kernels (f16: numpy only)


# ---- the router's twin ------------------------------------------------------------------------------
def lane_sum(q: np.ndarray) -> np.ndarray:
    """The router's sum over a row of q [rows, E] f32: lane l adds q[l + 32 i] in increasing i from
    0, then a butterfly over the 32 lanes (xor 16, 8, 4, 2, 1)."""
    rows, E = q.shape
    lanes = np.zeros((rows, 32), F32)
    for i in range(0, E, 32):
        part = np.zeros((rows, 32), F32)
        part[:, : min(32, E - i)] = q[:, i : i + 32]
        lanes = lanes + part
    idx = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[:, idx ^ o]
    return lanes[:, 0]


def route_ref(logits, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [rows, k], weights f32 [rows, k]) of router logits [rows, E] f32: softmax in f32
    (max, exp, lane_sum, divide), the k largest probabilities with ties to the lower expert, their
    probabilities (over their own sum, added in rank order, with `renormalize`), each row's entries
    in increasing expert id."""
    x = np.asarray(logits, F32)
    rows, E = x.shape
    q = np.exp(x - x.max(axis=1, keepdims=True)).astype(F32)
    p = (q / lane_sum(q)[:, None]).astype(F32)
    order = np.lexsort((np.broadcast_to(np.arange(E), p.shape), -p), axis=1)[:, :top_k]  # by -p, then by index
    ids = order.astype(np.int32)
    w = np.take_along_axis(p, order, axis=1)
    if renormalize:
        t = np.zeros(rows, F32)
        for j in range(top_k):
            t = t + w[:, j]
        w = (w / t[:, None]).astype(F32)
    by_id = np.argsort(ids, axis=1, kind="stable")
    return np.take_along_axis(ids, by_id, axis=1), np.take_along_axis(w, by_id, axis=1).astype(F32)


@dataclass
class Grouping:
    """The rows grouped by expert (host arrays, the router's last CTA's twin): expert e's grouped
    rows are offsets[e] .. offsets[e] + counts[e] - 1, its rows in increasing order; pos [rows, k]
    the grouped row of each entry, entry [P] the entry (r k + slot) of each grouped row and src [P]
    its token row; items [n, 2] the CTA-to-expert map (expert, tile of tile_rows rows); distinct the
    experts with rows."""
    counts: np.ndarray
    offsets: np.ndarray
    pos: np.ndarray
    entry: np.ndarray
    src: np.ndarray
    items: np.ndarray
    tile_rows: int

    @property
    def distinct(self) -> int:
        return int(np.count_nonzero(self.counts))

    def rows_of(self, e: int) -> slice:
        return slice(int(self.offsets[e]), int(self.offsets[e] + self.counts[e]))


def group_ref(ids, experts: int, tile_rows: int) -> Grouping:
    """The grouping of routed ids [rows, k] (moe_route_f32's last CTA, exactly)."""
    ids = np.asarray(ids, np.int32)
    rows, k = ids.shape
    counts = np.bincount(ids.reshape(-1), minlength=experts).astype(np.int32)
    offsets = (np.cumsum(counts) - counts).astype(np.int32)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")          # by expert, then by row (entries are row-major)
    pos = np.empty(rows * k, np.int32)
    pos[order] = np.arange(rows * k, dtype=np.int32)
    src = (order // max(k, 1)).astype(np.int32)
    items = np.array([(e, t) for e in range(experts) for t in range(-(-int(counts[e]) // tile_rows))],
                     np.int32).reshape(-1, 2)
    return Grouping(counts, offsets, pos.reshape(rows, k), order.astype(np.int32), src, items, int(tile_rows))


def max_items(rows: int, top_k: int, experts: int, tile_rows: int) -> int:
    """The most items (expert tiles) any routing of `rows` rows can make: sum over the routed
    experts of ceil(count / tile_rows), at most (P + distinct (tile_rows - 1)) / tile_rows, P = rows k
    entries and at most min(E, P) distinct experts; and at most P (a tile holds a row)."""
    P = rows * top_k
    return min(P, (P + min(experts, P) * (tile_rows - 1)) // tile_rows)


# ---- the grouped product's launch plan ---------------------------------------------------------------
@dataclass(frozen=True)
class GroupedPlan:
    """One launch of the grouped product over `rows` rows routed to `top_k` of `experts` experts,
    x [*, K] by w [E, K, N] of `itemsize`-byte entries (1: FP8, with its block scales): the entry,
    the worst-case grid (column tiles x K splits, items), the row tile (`tile_rows`: the tensor
    cores' BM, or every row of an expert on f32) and the K split (from K and N alone)."""
    entry: str
    rows: int
    top_k: int
    experts: int
    K: int
    N: int
    itemsize: int
    tile_rows: int
    col_tiles: int
    cols: int            # columns of a column tile
    splits: int
    kchunk: int
    grid_splits: int     # CTAs sharing a tile's K chunks (1: folded in one CTA)
    items: int           # the worst case of the map
    threads: int
    shared_mem: int

    @property
    def grid(self) -> tuple[int, int]:
        return self.col_tiles * self.grid_splits, self.items

    @property
    def P(self) -> int:
        return self.rows * self.top_k

    def entry_of(self, swiglu: bool) -> str:
        """The entry this plan launches: the down product over gate|up (`swiglu`) has its own."""
        return self.entry.replace("_bf16_", "_bf16_swiglu_") if swiglu else self.entry

    def ctas(self, grouping: Grouping) -> list[dict]:
        """The CTAs that do work for this routing (the map's items x column tiles x splits), each with
        its expert, tile, column tile, split, and the bytes it reads: the weights of its chunk (once
        per ROW_TILE rows on f32, once on the tensor cores; FP8: the bytes and the f32 scales of the
        blocks they lie in) and its rows of x."""
        out = []
        for i, (e, t) in enumerate(grouping.items):
            n_rows = min(self.tile_rows, int(grouping.counts[e]) - int(t) * self.tile_rows)
            passes = -(-n_rows // ROW_TILE) if self.itemsize == 4 else 1
            for c in range(self.col_tiles):
                width = min(self.cols, self.N - c * self.cols)
                for s in range(self.grid_splits):
                    k_rows = self.K if self.grid_splits == 1 else min(self.kchunk, self.K - s * self.kchunk)
                    w_bytes = passes * k_rows * width * self.itemsize
                    if self.itemsize == 1:  # the scales of its blocks (kchunk and BN are whole blocks)
                        w_bytes += 4 * -(-k_rows // FP8_BLOCK) * -(-width // FP8_BLOCK)
                    out.append({"item": i, "expert": int(e), "tile": int(t), "col_tile": c, "split": s,
                                "rows": n_rows, "w_bytes": w_bytes,
                                "x_bytes": n_rows * k_rows * 4})
        return out

    def expert_bytes(self, grouping: Grouping) -> dict[int, int]:
        """Expert -> the weight bytes this launch reads of it, from the CTA map."""
        out: dict[int, int] = {}
        for cta in self.ctas(grouping):
            out[cta["expert"]] = out.get(cta["expert"], 0) + cta["w_bytes"]
        return out


def grouped_plan(rows: int, top_k: int, experts: int, K: int, N: int, itemsize: int) -> GroupedPlan:
    """The grouped product's launch (pure): 16-bit weights take the tensor-core tile (BM 16 while an
    expert can have at most 16 rows, else 128) and its K split (mma_split_plan), in one CTA per chunk
    while the worst-case CTAs leave an H200 short; FP8 (itemsize 1) the same tiles and modes with
    linear_fp8's K split (a multiple of the 128-row scale block: fp8_plan's); f32 the f32 kernel's
    split (split_plan), an item holding all of an expert's rows."""
    if itemsize == 4:
        s, kchunk = split_plan(K, N)
        bm = max(1, rows)
        return GroupedPlan("moe_linear_f32", rows, top_k, experts, K, N, 4, bm, tiles(N, 4), 128, s, kchunk, s,
                           max_items(rows, top_k, experts, bm), LINEAR_THREADS, 0)
    bm = MMA_TILES[0] if rows <= MMA_TILES[0] else MMA_TILES[-1]
    bn, _, warps, _ = MMA_CONFIGS[bm]
    fp8 = itemsize == 1
    splits, kchunk = mma_split_plan(K, N, FP8_ALIGN) if fp8 else mma_split_plan(K, N)
    n_tiles, items = max(1, -(-N // bn)), max_items(rows, top_k, experts, bm)
    split = splits > 1 and items * n_tiles < MMA_TARGET_CTAS
    entry = f"moe_linear_{'fp8' if fp8 else 'mma'}_bf16_m{bm}"
    return GroupedPlan(entry, rows, top_k, experts, K, N, itemsize, bm, n_tiles, bn,
                       splits, kchunk, splits if split else 1, items, 32 * warps, mma_shared_mem(bm))


def swiglu_fused(tile_rows: int, itemsize: int) -> bool:
    """Whether a grouped down product of `tile_rows` row tiles over experts of `itemsize` bytes takes
    its SwiGLU in the activation stage (16-bit and FP8 experts, the 16-row tile)."""
    return itemsize in (1, 2) and tile_rows == MMA_TILES[0]


# ---- the ops ---------------------------------------------------------------------------------------
@dataclass
class Routing:
    """One pass's routing (backend arrays): ids, weights, pos [rows, k] (entries in increasing
    expert id), src [P], counts, offsets [E], items [max items, 2] and stats [items, distinct
    experts]; on numpy also the host Grouping. `tile_rows`: the row tile its map was made for."""
    rows: int
    top_k: int
    experts: int
    tile_rows: int
    ids: object
    weights: object
    pos: object
    src: object
    counts: object
    offsets: object
    items: object
    stats: object
    grouping: Grouping | None = None

    @property
    def P(self) -> int:
        return self.rows * self.top_k


def grouped_rows(be, ws, name: str, n: int, per_row: int, tail: tuple = (), dtype=F32):
    """Rows [0, n) of a buffer of per_row rows per pass row (the grouped rows of a pass: k each):
    the workspace's of rows_max * per_row rows, so every width of a recorded pass shares it."""
    if ws is None:
        return be.xp.empty((n, *tail), dtype)
    return ws.fixed(name, (ws.rows_max * per_row, *tail), dtype)[:n]


def route(be, logits, experts: int, top_k: int, renormalize: bool, tile_rows: int, *, layer: int | None = None,
          ws=None) -> Routing:
    """The routing of logits [rows, >= experts] f32 (a router GEMM's output, its first `experts`
    columns; more columns may follow, such as the shared expert's gate), its map made for row tiles of
    `tile_rows`. `layer`: where it reports its distinct experts (dspark.profile.experts)."""
    logits = adopt(be, logits=logits)
    require_ndim(logits, 2, "logits", "[rows, experts]")
    require_dtype(logits, F32, "logits")
    rows, width = logits.shape
    if not 1 <= experts <= min(width, MAX_EXPERTS):
        raise ShapeError(f"experts={experts}: expected 1 to min(logits' {width} columns, {MAX_EXPERTS})")
    if not 1 <= top_k <= min(experts, MAX_TOP_K):
        raise ShapeError(f"top_k={top_k}: expected 1 to min(experts={experts}, {MAX_TOP_K})")
    if tile_rows < 1:
        raise ShapeError(f"tile_rows={tile_rows}: expected >= 1")
    P, xp = rows * top_k, be.xp
    logits = xp.ascontiguousarray(logits)
    if be.kernels is None:
        ids, weights = route_ref(np.asarray(logits)[:, :experts], top_k, renormalize)
        g = group_ref(ids, experts, tile_rows)
        if layer is not None and profile.listening_experts():
            profile.experts(layer, g.distinct, (experts, top_k))
        return Routing(rows, top_k, experts, tile_rows, ids, weights, g.pos, g.src, g.counts, g.offsets, g.items,
                       np.array([len(g.items), g.distinct], np.int32), g)
    n_items = max(1, max_items(rows, top_k, experts, tile_rows))
    r = Routing(rows, top_k, experts, tile_rows,
                ids=grouped_rows(be, ws, "moe.ids", P, top_k, (), np.int32),
                weights=grouped_rows(be, ws, "moe.weights", P, top_k),
                pos=grouped_rows(be, ws, "moe.pos", P, top_k, (), np.int32),
                src=grouped_rows(be, ws, "moe.src", P, top_k, (), np.int32),
                counts=_fixed(be, ws, "moe.counts", (experts,), np.int32),
                offsets=_fixed(be, ws, "moe.offsets", (experts,), np.int32),
                items=grouped_rows(be, ws, "moe.items", n_items, top_k, (2,), np.int32),
                # Each layer's own (its distinct experts are read after the pass: profile.experts).
                stats=_fixed(be, ws, "moe.stats" if layer is None else f"moe.stats.{layer}", (2,), np.int32))
    if rows:
        tickets, _ = rowsplit.scratch(be, 1, ws=ws)
        rowsplit.launch(be, "moe_route_f32", -(-rows // ROUTE_WARPS), ROUTE_THREADS,
                        (logits, np.int64(width), np.int32(rows), np.int32(experts), np.int32(top_k),
                         np.int32(bool(renormalize)), np.int32(tile_rows), r.ids, r.weights, r.pos, r.src, r.counts,
                         r.offsets, r.items, r.stats, tickets))
    else:
        r.stats[...] = 0
    r.ids, r.weights, r.pos = (a.reshape(rows, top_k) for a in (r.ids, r.weights, r.pos))
    if layer is not None and profile.listening_experts():
        # A host count on the CPU backends; on a GPU the router's, in the layer's own stats, read later.
        if xp is np:
            profile.experts(layer, int(r.stats[1]), (experts, top_k))
        else:
            profile.experts(layer, r.stats[1:2], (experts, top_k), xp)
    return r


def _fixed(be, ws, name, shape, dtype):
    return be.xp.empty(shape, dtype) if ws is None else ws.fixed(name, shape, dtype)


def grouped_linear(be, x, w, routing: Routing, *, gather: bool, out=None, ws=None, name: str = "moe.grouped",
                   swiglu: bool = False):
    """Grouped row g of expert e: x[src[g]] @ w[e] (`gather`: x [rows, K], a pass's rows) or x[g] @
    w[e] (x [P, K], already grouped) -> out f32 [P, N], for w [E, K, N] f32 / f16 / bf16, or an
    Fp8Stack (bf16 compute on the kernels). `swiglu`: x is the grouped rows' gate|up [P, 2K] and the
    product runs over SwiGLU(x), bitwise `activation.swiglu` then the product: 16-bit and FP8 experts
    in the 16-row tile's activation stage (moe_linear_<kind>_bf16_swiglu_m16: one launch); f32
    experts, a prompt's 128-row tiles (which would read both f32 halves once per column tile) and
    numpy by those two steps (the activations in the workspace's `name`.act)."""
    if swiglu:
        if gather:
            raise ShapeError("gather: the SwiGLU product reads grouped rows (gather=False)")
        gate_up = adopt(be, gate_up=x)
        width = gate_up_width(gate_up)
        itemsize = 1 if isinstance(w, Fp8Stack) else np.dtype(adopt(be, w=w).dtype).itemsize
        if be.kernels is None or not swiglu_fused(routing.tile_rows, itemsize):
            act = swiglu_op(be, gate_up, out=grouped_rows(be, ws, f"{name}.act", routing.P, routing.top_k, (width,)))
            return grouped_linear(be, act, w, routing, gather=False, out=out, ws=ws, name=name)
    fp8 = isinstance(w, Fp8Stack)
    if fp8:
        x, q, scale, out = adopt(be, x=x, q=w.q, scale=w.scale, out=out, writes=("out",))
        require_ndim(q, 3, "w.q", "[experts, K, N]")
        require_dtype(q, np.uint8, "w.q")
        require_dtype(scale, F32, "w.scale")
        require_shape(scale, (q.shape[0], *scale_grid(*q.shape[1:])), "w.scale")
    else:
        x, w, out = adopt(be, x=x, w=w, out=out, writes=("out",))
        require_ndim(w, 3, "w", "[experts, K, N]")
        suffix(w.dtype, "w")  # f32, f16 or bf16 (numpy multiplies any; the kernels below take f32 or bf16)
    require_ndim(x, 2, "x", "[rows, K]")
    require_dtype(x, F32, "x")
    E, K, N = q.shape if fp8 else w.shape
    P = routing.P
    if E != routing.experts:
        raise ShapeError(f"w has {E} experts: the routing has {routing.experts}")
    want_rows = routing.rows if gather else P
    width = 2 * K if swiglu else K
    if x.shape != (want_rows, width):
        raise ShapeError(f"x has shape {tuple(x.shape)}: expected ({want_rows}, {width})"
                         + (" (the pass's rows, gathered)" if gather else " (the grouped rows' gate|up)" if swiglu
                            else " (the grouped rows)"))
    out = grouped_rows(be, ws, name, P, routing.top_k, (N,)) if out is None else out
    require_shape(out, (P, N), "out")
    require_dtype(out, F32, "out")
    if be.kernels is None:
        g = routing.grouping
        for e in np.flatnonzero(g.counts):  # one native product per expert, over its rows
            at = g.rows_of(int(e))
            rows_x = x[g.src[at]] if gather else x[at]
            out[at] = product.host_linear_fp8(rows_x, q[int(e)], scale[int(e)]) if fp8 else \
                product.host_linear(rows_x, w[int(e)])
        return out
    if not P or not N:
        return out
    plan = grouped_plan(routing.rows, routing.top_k, E, K, N, 1 if fp8 else w.dtype.itemsize)
    if plan.tile_rows != routing.tile_rows:
        raise ShapeError(f"routing made its map for tiles of {routing.tile_rows} rows: this product's plan takes "
                         f"{plan.tile_rows} (route with grouped_plan(...).tile_rows)")
    if fp8 and np.dtype(w.compute) != BF16:
        raise DTypeError(f"w.compute is {np.dtype(w.compute)}: the FP8 experts' kernels multiply with bfloat16 "
                         f"activations")
    if not fp8 and w.dtype not in KERNEL_DTYPES:
        raise DTypeError(f"w has dtype {w.dtype}: the grouped product's kernels take float32 or bfloat16")
    if fp8 or w.dtype.itemsize == 2:
        _require_tensor_cores(be)
    xp = be.xp
    x = xp.ascontiguousarray(x)
    weights = (xp.ascontiguousarray(q), xp.ascontiguousarray(scale)) if fp8 else (xp.ascontiguousarray(w),)
    partial = plan.grid_splits > 1
    part = grouped_rows(be, ws, f"{name}.part.{plan.splits}", plan.splits * P, routing.top_k * plan.splits, (N,)) \
        if partial else _fixed(be, ws, "linear.part", (1,), F32)
    tickets, _ = rowsplit.scratch(be, plan.items * plan.col_tiles, ws=ws)
    common = (x, routing.src if gather else None, *weights, routing.counts, routing.offsets, routing.items,
              routing.stats)
    if plan.itemsize == 4:
        args = (*common, np.int32(plan.tile_rows), np.int32(K), np.int32(N), np.int32(plan.kchunk),
                np.int32(plan.splits), out, part, np.int32(P), tickets)
    else:
        args = (*common, np.int32(K), np.int32(N), np.int32(plan.kchunk), np.int32(plan.grid_splits), out, part,
                np.int32(P), tickets)
    rowsplit.launch(be, plan.entry_of(swiglu), plan.grid, plan.threads, args, shared_mem=plan.shared_mem)
    return out


def grouped_linear_ref(x, w: Fp8Stack, grouping: Grouping, *, gather: bool) -> np.ndarray:
    """The FP8 grouped product's arithmetic on host arrays, bitwise (moe_linear_fp8_bf16_m<BM>):
    grouped row g of expert e is linear_fp8_ref of its row by expert e's bytes and scales in
    w.compute, with the plan's K chunk (linear_fp8's, from K and N)."""
    q, scale = np.asarray(w.q), np.asarray(w.scale)
    E, K, N = q.shape
    kchunk = mma_split_plan(K, N, FP8_ALIGN)[1]
    x = np.asarray(x, F32)
    out = np.zeros((int(grouping.counts.sum()), N), F32)
    for e in np.flatnonzero(grouping.counts):
        at = grouping.rows_of(int(e))
        out[at] = linear_fp8_ref(x[grouping.src[at]] if gather else x[at], q[e], scale[e], w.compute, kchunk)
    return out


def combine_ref(y, pos, weights, shared=None, gate=None) -> np.ndarray:
    """The combine kernel's arithmetic on host arrays: a row's entries (increasing expert id)
    weighted and added from 0 in that order, then sigmoid(gate) * shared."""
    y, pos, weights = np.asarray(y, F32), np.asarray(pos), np.asarray(weights, F32)
    acc = np.zeros((pos.shape[0], y.shape[1]), F32)
    for j in range(pos.shape[1]):
        acc = acc + weights[:, j : j + 1] * y[pos[:, j]]
    if shared is not None:
        acc = acc + dense.sigmoid(np.asarray(gate, F32))[:, None] * np.asarray(shared, F32)
    return acc


def combine(be, y, routing: Routing, *, shared=None, gate=None, out=None):
    """out [rows, N] f32: each row's expert outputs y [P, N] (the grouped rows) by their weights, in
    increasing expert id, plus sigmoid(gate) * shared where the model has a gated shared expert:
    shared [rows, N], gate = (src [rows, width] f32, column): the gate logits are src[:, column] (a
    column of the router's GEMM)."""
    y, out = adopt(be, y=y, out=out, writes=("out",))
    require_ndim(y, 2, "y", "[P, N]")
    require_dtype(y, F32, "y")
    rows, k, N = routing.rows, routing.top_k, y.shape[1]
    require_shape(y, (routing.P, N), "y")
    if (shared is None) != (gate is None):
        raise ShapeError("shared and gate: give both (a gated shared expert) or neither")
    src = column = None
    if shared is not None:
        src, column = gate
        shared, src = adopt(be, shared=shared, gate=src)
        require_shape(shared, (rows, N), "shared")
        require_dtype(shared, F32, "shared")
        require_ndim(src, 2, "gate", "[rows, width]")
        require_dtype(src, F32, "gate")
        if src.shape[0] != rows or not 0 <= column < src.shape[1]:
            raise ShapeError(f"gate has shape {tuple(src.shape)}: expected {rows} rows holding column {column}")
    out = be.xp.empty((rows, N), F32) if out is None else out
    require_shape(out, (rows, N), "out")
    require_dtype(out, F32, "out")
    if be.kernels is None:
        out[...] = 0
        g, w = routing.grouping, np.asarray(routing.weights).reshape(-1)
        for e in np.flatnonzero(g.counts):  # transformers' eager loop: experts in increasing id, so each
            at = g.rows_of(int(e))           # row adds its outputs in increasing expert id (combine_ref's order)
            r = g.src[at]
            out[r] = out[r] + w[g.entry[at], None] * y[at]
        if shared is not None:
            out[...] = out + dense.sigmoid(np.asarray(src)[:, column])[:, None] * shared
        return out
    if rows * N:
        be.kernels.get_function("moe_combine_f32")(
            (-(-rows * N // COMBINE_THREADS),), (COMBINE_THREADS,),
            (be.xp.ascontiguousarray(y), routing.pos, routing.weights,
             None if shared is None else be.xp.ascontiguousarray(shared),
             None if src is None else be.xp.ascontiguousarray(src).reshape(-1)[column:],
             np.int64(0 if src is None else src.shape[1]), np.int32(rows), np.int32(k), np.int32(N), out))
    return out
