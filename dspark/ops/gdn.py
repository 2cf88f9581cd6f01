"""The gated delta-rule scan of the gdn mixer (kernels: csrc/gdn_scan.cu, helpers csrc/gdn.cuh).

Per session, per value head h, per token (column) t of the projected input `mixed` [cols, C],
with C = Hk*2*dk + H*dv channels laid out [q (Hk heads) | k (Hk heads) | v (H heads)]:

    x     = SiLU(causal depthwise conv, width 4, over [conv window (3 previous inputs), mixed_t])
    q, k  = L2-normalised per key head (eps 1e-6 inside the sqrt); q also scaled by 1/sqrt(dk)
    alpha = exp(-exp(A_log) * softplus(a_t + dt_bias)),   beta = sigmoid(b_t)
    S     = alpha * S (I - beta k k^T) + beta v k^T        (S: f32 [dv, dk] per value head)
    o_t   = S q

Value head h reads key head h // (H / Hk): consecutive value heads share a key head (Qwen3.5 has
2 or 3 value heads per key head; transformers' repeat_interleave). Evaluated in one fixed order
(csrc/gdn.cuh): S <- alpha S; u = S k; S <- S + (beta (v - u)) k^T; o = S q, each dot product
summed the kernel's way (`lane_columns`, then an xor butterfly).

One op serves decode (t = 1), verify (t = vt, with per-column checkpoints for rollback), replay
(t = keep) and prefill. Nothing in the arithmetic depends on how many columns or sessions share a
launch, so a verify column is bitwise equal to the decode step at the same position, on every
backend. The NumPy functions here are the numpy backend's implementation and the kernels' oracle:
they follow their evaluation order, but sum each dot product of the state update in NumPy's own
fixed (pairwise, per row) order instead of the kernel's lane order, which would cost several
fancy-indexed passes per column on the fast CPU path. Either order is fixed per row, so each
backend is row-invariant on its own; the two agree within the 1e-5 the tests allow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import profile
from ..errors import CapacityError, ShapeError
from ..arrays import adopt
from . import dense, host, rowsplit
from .checks import host_and_device, require_dtype, require_indptr, require_ndim, require_shape
from .snapshot import require_tensor
from .tables import PointerTable, as_table
from .workspace import fixed

F32 = np.float32
SUPPORTED_DK = (16, 32, 64, 128)
MAX_THREADS = 512
TAPS = 4                # causal conv width
WINDOW = TAPS - 1       # previous inputs kept per channel, oldest first
NORM_EPS = F32(1e-6)
SOFTPLUS_THRESHOLD = F32(20)


# ---- the kernel's layout, shared by the launch plan and the reference's summation order ------
def tile(dk: int) -> tuple[int, int]:
    """(lanes per state row, state columns per thread) of the kernel's GdnTile<dk>."""
    cols = min(dk, 32)
    return dk // cols, cols


def lane_columns(dk: int) -> np.ndarray:
    """[lanes, cols]: the state column that lane p of a row adds at step m = 4 g + e of its
    dot products, 4 (p + lanes g) + e (float4 groups interleaved across the row's lanes)."""
    lanes, cols = tile(dk)
    g, e = np.divmod(np.arange(cols), 4)
    return 4 * (np.arange(lanes)[:, None] + lanes * g[None, :]) + e[None, :]


def block_threads(dk: int, dv: int) -> int:
    """One thread per (state row, lane), rounded up to whole warps."""
    return -(-dv * tile(dk)[0] // 32) * 32


def channels(heads: int, dk: int, dv: int, k_heads: int | None = None) -> int:
    """Conv channels of a layer with `heads` value heads and `k_heads` key heads (default: heads)."""
    return (heads if k_heads is None else k_heads) * 2 * dk + heads * dv


SLICE_THREADS = 128   # gdn_scan: the most threads a block takes (kGdnSliceThreads), lanes x its slice's rows


def slice_rows(dk: int, dv: int) -> int:
    """The state rows of one block of the scan: SLICE_THREADS / lanes(dk), at most dv (dk 128: 32 rows,
    so a head's 128 rows take four blocks, four SMs' loads and stores in flight)."""
    return min(dv, SLICE_THREADS // tile(dk)[0])


def scan_plan(heads: int, dk: int, dv: int, k_heads: int | None = None,
              rows: int | None = None) -> tuple[str, int, int, int]:
    """(kernel name, threads per block, dynamic shared bytes, state rows per block) for value heads
    of [dv, dk], each in blocks of `rows` state rows (default slice_rows)."""
    if not isinstance(dk, (int, np.integer)) or dk not in SUPPORTED_DK:
        raise ShapeError(f"dk={dk}: expected one of {', '.join(map(str, SUPPORTED_DK))}")
    if not (isinstance(heads, (int, np.integer)) and heads >= 1):
        raise ShapeError(f"heads={heads!r}: expected an int >= 1")
    if k_heads is not None and not (isinstance(k_heads, (int, np.integer)) and k_heads >= 1 and heads % k_heads == 0):
        raise ShapeError(f"k_heads={k_heads!r}: expected an int >= 1 that divides heads={heads}")
    if not (isinstance(dv, (int, np.integer)) and dv >= 1):
        raise ShapeError(f"dv={dv!r}: expected an int >= 1")
    if block_threads(dk, dv) > MAX_THREADS:
        raise CapacityError(f"dv={dv} with dk={dk} needs {block_threads(dk, dv)} threads per head: expected "
                            f"dv <= {MAX_THREADS // tile(dk)[0]}")
    rows = slice_rows(dk, dv) if rows is None else int(rows)
    if not 1 <= rows <= slice_rows(dk, dv):
        raise ShapeError(f"rows={rows}: expected 1 .. {slice_rows(dk, dv)} state rows a block")
    return f"gdn_scan_dk{int(dk)}_f32", block_threads(dk, rows), scan_smem(dk, rows), rows


# ---- NumPy reference ------------------------------------------------------------------------
def gdn_gates_ref(a, b, A_log, dt_bias) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, beta), each shaped like `a` [..., H]."""
    with np.errstate(over="ignore"):
        x = a + dt_bias
        softplus = np.where(x > SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(x)))
        return np.exp(-(np.exp(A_log) * softplus)), F32(1) / (F32(1) + np.exp(-b))


def conv_silu_ref(window, weight, x) -> tuple[np.ndarray, np.ndarray]:
    """(SiLU(conv) [N, C], shifted window [N, C, 3]) for windows [N, C, 3] and inputs [N, C]."""
    y = weight[:, 0] * window[..., 0] + weight[:, 1] * window[..., 1] + weight[:, 2] * window[..., 2] \
        + weight[:, 3] * x
    with np.errstate(over="ignore"):
        act = y / (F32(1) + np.exp(-y))
    return act, np.concatenate([window[..., 1:], x[..., None]], axis=-1)


def _butterfly(p: np.ndarray, lanes: int) -> np.ndarray:
    """Every lane's value after the xor butterfly over the last axis (`lanes` wide)."""
    lane = np.arange(lanes)
    o = lanes // 2
    while o:
        p = p + p[..., lane ^ o]
        o //= 2
    return p


def l2norm_ref(x, scale) -> np.ndarray:
    """(x * 1/sqrt(sum x^2 + eps)) * scale over the last axis, summed as one warp does: lane l
    adds x[l], x[l+32], ... in order, then the butterfly."""
    n = x.shape[-1]
    padded = np.zeros(x.shape[:-1] + (-(-n // 32) * 32,), F32)
    padded[..., :n] = x
    padded = padded.reshape(x.shape[:-1] + (-1, 32))
    ss = np.zeros(x.shape[:-1] + (32,), F32)
    for r in range(padded.shape[-2]):
        ss = ss + padded[..., r, :] * padded[..., r, :]
    inv = F32(1) / np.sqrt(_butterfly(ss, 32)[..., :1] + NORM_EPS)
    return x * inv * scale


def delta_rule_ref(S, q, k, v, alpha, beta) -> tuple[np.ndarray, np.ndarray]:
    """One token for N sessions: (new S, o [N, H, dv]). S [N, H, dv, dk]; q, k [N, H, dk];
    v [N, H, dv]; alpha, beta [N, H]. Each dot product is one NumPy sum over dk."""
    S = S * alpha[..., None, None]
    u = (S * k[..., None, :]).sum(axis=-1)
    delta = beta[..., None] * (v - u)
    S = S + delta[..., None] * k[..., None, :]
    return S, (S * q[..., None, :]).sum(axis=-1)


def conv_windows_of(windows, mixed, col_indptr) -> np.ndarray:
    """The conv window each column sees [cols, C, 3]: the session's last 3 inputs before it,
    from its starting window [B, C, 3] and the columns before it."""
    B, C = windows.shape[:2]
    t = np.diff(col_indptr)
    total = int(col_indptr[-1])
    sess = np.repeat(np.arange(B), t)
    j = np.arange(total) - col_indptr[:-1][sess]
    start = col_indptr[:-1] + 3 * np.arange(B)  # session b's history in `hist`: 3 window rows, then inputs
    hist = np.empty((total + 3 * B, C), F32)
    hist[start[:, None] + np.arange(3)] = windows.transpose(0, 2, 1)
    hist[start[sess] + 3 + j] = mixed[:total]
    return hist[start[sess][:, None] + j[:, None] + np.arange(3)].transpose(0, 2, 1)


def delta_walk_ref(S, q, k, v, alpha, beta, col_indptr, out, state_ckpt=None) -> None:
    """Each session's columns in order through delta_rule_ref, all sessions with a column left
    advancing together: S [B, H, dv, dk] in place -> out [cols, H, dv] (and the state after each
    column in state_ckpt). dspark.ops.host.delta_walk is its native twin, bit for bit."""
    t = np.diff(col_indptr)
    for j in range(int(t.max())):
        sel = np.flatnonzero(t > j)
        cols = col_indptr[sel] + j
        S[sel], out[cols] = delta_rule_ref(S[sel], q[cols], k[cols], v[cols], alpha[cols], beta[cols])
        if state_ckpt is not None:
            state_ckpt[cols] = S[sel]


def gdn_scan_ref(mixed, a, b, conv_weight, A_log, dt_bias, states, conv_windows, col_indptr, heads, dk, dv,
                 out, state_ckpt=None, conv_ckpt=None, k_heads=None, commit=True, walk=None) -> None:
    """The scan on host arrays, in place (the live states and windows only with commit); each
    column computed exactly as one decode step. `walk`: delta_walk_ref's twin to run instead (the
    numpy backend passes dspark.ops.host.delta_walk).

    Everything before the state update (conv, SiLU, norms, gates) depends only on the inputs,
    so it runs for all columns at once, elementwise, with the same per-column arithmetic; only
    the delta rule walks the columns, all sessions with a column left advancing together."""
    t = np.diff(col_indptr)
    if not t.size or not t.max():
        return
    total = int(col_indptr[-1])
    x, windows = conv_silu_ref(conv_windows_of(np.stack(conv_windows), mixed, col_indptr), conv_weight,
                               mixed[:total])
    if conv_ckpt is not None:
        conv_ckpt[:total] = windows
    k_heads = heads if k_heads is None else k_heads
    hk = k_heads * dk
    group = heads // k_heads  # value heads per key head, consecutive
    q = np.repeat(l2norm_ref(x[:, :hk].reshape(-1, k_heads, dk), F32(1) / np.sqrt(F32(dk))), group, axis=1)
    k = np.repeat(l2norm_ref(x[:, hk:2 * hk].reshape(-1, k_heads, dk), F32(1)), group, axis=1)
    v = x[:, 2 * hk:].reshape(-1, heads, dv)
    alpha, beta = gdn_gates_ref(a[:total], b[:total], A_log, dt_bias)
    S = np.stack(states)  # [B, H, dv, dk]
    (walk or delta_walk_ref)(S, q, k, v, alpha, beta, col_indptr, out, state_ckpt)
    for s in np.flatnonzero(t) if commit else ():
        states[s][...] = S[s]
        conv_windows[s][...] = windows[col_indptr[s + 1] - 1]


# ---- the layer's inputs: one projection row ---------------------------------------------------
@dataclass(frozen=True)
class ProjLayout:
    """Where one gdn layer's inputs sit in a row of its input projection: mixed [C] at `mixed`, the
    output gate z [H dv] at `z`, a [H] at `a` and b [H] at `b` (column offsets)."""
    mixed: int
    z: int
    a: int
    b: int

    @classmethod
    def packed(cls, heads: int, dk: int, dv: int, k_heads: int | None = None) -> "ProjLayout":
        """[mixed | z | a | b], as the trunk's fused w_in writes them."""
        C = channels(heads, dk, dv, k_heads)
        return cls(0, C, C + heads * dv, C + heads * dv + heads)


def gdn_proj(mixed, a, b, z=None) -> np.ndarray:
    """A projection row block [mixed | z | a | b] of separate host arrays (ProjLayout.packed's layout
    when z [cols, H dv] is given; without z, [mixed | a | b]: tests and benchmarks)."""
    cols, H = a.shape
    if z is None:
        z = np.zeros((cols, 0), F32)
    return np.concatenate([mixed, np.asarray(z, F32).reshape(cols, -1), a, b], axis=1).astype(F32)


def _ckpt_target(ckpt, col_count, shape):
    """Where the scan writes a checkpoint: the caller's array itself when every column is taken
    (no col_count) and it is a C-contiguous f32 host array (a verify's 8 columns of states, 2 MB a
    layer at 16 heads of 64 x 64, are then written once, not zeroed, written and copied), else a
    fresh one copied into it after."""
    if ckpt is None:
        return None
    if (col_count is None and isinstance(ckpt, np.ndarray) and ckpt.dtype == F32 and ckpt.flags.c_contiguous
            and ckpt.shape[1:] == shape[1:] and ckpt.shape[0] >= shape[0]):
        return ckpt[: shape[0]]
    return np.zeros(shape, F32)


def gdn_layer_ref(proj, layout: ProjLayout, conv_weight, A_log, dt_bias, states, conv_windows, col_indptr, heads,
                  dk, dv, out=None, state_ckpt=None, conv_ckpt=None, k_heads=None, commit=True, col_count=None,
                  o_norm=None, eps: float = 1e-6, norm=None) -> None:
    """The fused kernel's work on host arrays, in place: the scan of each session's columns (its
    first col_count[b] when given) over the inputs `layout` reads from proj, then, with o_norm,
    out = norm(o) * silu(z) (`norm`: the numpy backend's by default; dspark.ops.norm.rmsnorm_ref sums
    as the kernel does)."""
    from .norm import numpy_rmsnorm
    C = channels(heads, dk, dv, k_heads)
    indptr = np.asarray(col_indptr, np.int64)
    if col_count is None:
        rows = np.arange(int(indptr[-1]))
        counts = np.diff(indptr)
    else:
        counts = np.asarray(col_count, np.int64)
        rows = np.concatenate([indptr[b] + np.arange(counts[b]) for b in range(counts.size)]).astype(np.int64) \
            if counts.size else np.zeros(0, np.int64)
    sub = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    p = np.asarray(proj, F32)[rows]
    H = heads
    o = np.zeros((rows.size, H, dv), F32)
    sck = _ckpt_target(state_ckpt, col_count, (rows.size, H, dv, dk))
    cck = _ckpt_target(conv_ckpt, col_count, (rows.size, C, WINDOW))
    gdn_scan_ref(p[:, layout.mixed : layout.mixed + C], p[:, layout.a : layout.a + H], p[:, layout.b : layout.b + H],
                 conv_weight, A_log, dt_bias, states, conv_windows, sub, heads, dk, dv, o, sck, cck, k_heads, commit,
                 walk=host.delta_walk if host.NATIVE else None)
    if sck is not None and not np.may_share_memory(sck, state_ckpt):
        state_ckpt[rows] = sck
    if cck is not None and not np.may_share_memory(cck, conv_ckpt):
        conv_ckpt[rows] = cck
    if out is not None:
        if o_norm is not None:
            z = p[:, layout.z : layout.z + H * dv].reshape(-1, H, dv)
            o = (norm or numpy_rmsnorm)(o, o_norm, eps) * dense.silu(z)
        out[rows] = o.reshape(out[rows].shape)


# ---- op ---------------------------------------------------------------------------------------
def check_layer_inputs(be, mixed, a, b, conv_weight, A_log, dt_bias, col_indptr, heads, dk, dv, k_heads):
    """One gdn layer's inputs to a launch (shapes and f32), and its row pointer on the host and the
    backend: (C, cols, host col_indptr, device col_indptr)."""
    C = channels(heads, dk, dv, k_heads)
    require_ndim(mixed, 2, "mixed", "[cols, C]")
    cols = mixed.shape[0]
    for arg, what, shape in ((mixed, "mixed", (cols, C)), (a, "a", (cols, heads)), (b, "b", (cols, heads)),
                             (conv_weight, "conv_weight", (C, TAPS)), (A_log, "A_log", (heads,)),
                             (dt_bias, "dt_bias", (heads,))):
        require_shape(arg, shape, what)
        require_dtype(arg, np.float32, what)
    host_indptr, dev_indptr = host_and_device(be, col_indptr)
    require_indptr(host_indptr, "col_indptr", cols)
    return C, cols, host_indptr, dev_indptr


def gdn_scan(be, mixed, a, b, conv_weight, A_log, dt_bias, states, conv_windows, col_indptr, *,
             heads, dk, dv, k_heads=None, out=None, state_ckpt=None, conv_ckpt=None, commit=True):
    """Run each session's columns of one gdn layer through the recurrence -> out [cols, H, dv] f32
    (o itself: gdn_layer with the inputs as separate arrays, for tests and tools).

    heads H counts value heads (one state each), k_heads Hk key heads (default H; H must be a
    multiple). mixed [cols, C], a and b [cols, H], conv_weight [C, 4], A_log and dt_bias [H]: f32,
    with C = Hk*2*dk + H*dv. The rest as gdn_layer.
    """
    mixed, a, b = adopt(be, mixed=mixed, a=a, b=b)
    scan_plan(heads, dk, dv, k_heads)
    C = channels(heads, dk, dv, k_heads)
    require_ndim(mixed, 2, "mixed", "[cols, C]")
    cols = mixed.shape[0]
    for arg, what, shape in ((mixed, "mixed", (cols, C)), (a, "a", (cols, heads)), (b, "b", (cols, heads))):
        require_shape(arg, shape, what)
        require_dtype(arg, np.float32, what)
    proj = be.xp.concatenate([mixed, a, b], axis=1)
    return gdn_layer(be, proj, conv_weight, A_log, dt_bias, states, conv_windows, col_indptr, heads=heads, dk=dk,
                     dv=dv, k_heads=k_heads, layout=ProjLayout(0, C, C, C + heads), out=out, state_ckpt=state_ckpt,
                     conv_ckpt=conv_ckpt, commit=commit)


def gdn_layer(be, proj, conv_weight, A_log, dt_bias, states, conv_windows, col_indptr, *, heads, dk, dv, k_heads=None,
              layout: ProjLayout | None = None, o_norm=None, eps: float = 1e-6, col_count=None, out=None,
              want_out: bool = True, state_ckpt=None, conv_ckpt=None, commit=True, ws=None, block_rows=None):
    """Run each session's columns of one gdn layer through conv, recurrence and output norm, in one
    launch -> out [cols, H, dv] f32 (the gated norm of o with o_norm, o itself without).

    proj [cols, width] f32: each column's input projection, read where `layout` says (default
    ProjLayout.packed: [mixed (C) | z (H dv) | a (H) | b (H)], the trunk's w_in), with C = Hk*2*dk +
    H*dv channels [q (Hk heads) | k (Hk heads) | v (H heads)]. heads H counts value heads (one state
    each), k_heads Hk key heads (default H; H must be a multiple). conv_weight [C, 4], A_log and
    dt_bias [H], o_norm [dv]: f32. col_indptr int32 [B+1] gives session s the columns col_indptr[s]
    .. col_indptr[s+1] (host or Staged: validated on the host, read by the kernel from the device);
    col_count int32 [B] (replay) takes only the first col_count[s] of them; a session with none is
    left alone. states: B arrays [H, dv, dk] and conv_windows: B arrays [C, 3] (the 3 previous
    inputs, oldest first), f32, or PointerTables of them (dspark.ops.tables); updated in place when
    `commit`, only read otherwise (a speculative verify: the round's rollback moves them on).
    state_ckpt [cols, H, dv, dk] and conv_ckpt [cols, C, 3], when given, receive the state and the
    window after every column (for checkpoint_select). want_out=False writes no output (replay).
    dk in {16, 32, 64, 128}; dv <= 512 / lanes(dk) (128 for dk = 128). `ws`: the workspace the
    tickets come from (dspark.ops.workspace; default the row-split pool). `block_rows`: the state rows
    of each block (scan_plan; a test knob: the bits never depend on it).
    """
    proj, conv_weight, A_log, dt_bias, o_norm, out, state_ckpt, conv_ckpt = adopt(
        be, proj=proj, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias, o_norm=o_norm, out=out,
        state_ckpt=state_ckpt, conv_ckpt=conv_ckpt, writes=("out", "state_ckpt", "conv_ckpt"))
    if not isinstance(states, PointerTable):
        states = adopt(be, states=states, writes=("states",) if commit else ())
    if not isinstance(conv_windows, PointerTable):
        conv_windows = adopt(be, conv_windows=conv_windows, writes=("conv_windows",) if commit else ())
    name, threads, smem, rows = scan_plan(heads, dk, dv, k_heads, block_rows)
    k_heads = heads if k_heads is None else int(k_heads)
    C = channels(heads, dk, dv, k_heads)
    layout = layout or ProjLayout.packed(heads, dk, dv, k_heads)
    require_ndim(proj, 2, "proj", "[cols, width]")
    require_dtype(proj, np.float32, "proj")
    cols, width = proj.shape
    spans = {"mixed": (layout.mixed, C), "a": (layout.a, heads), "b": (layout.b, heads)}
    if o_norm is not None:
        spans["z"] = (layout.z, heads * dv)
    for what, (at, n) in spans.items():
        if not 0 <= at <= width - n:
            raise ShapeError(f"proj has {width} columns: {what} [{n}] at column {at} does not fit")
    for arg, what, shape in ((conv_weight, "conv_weight", (C, TAPS)), (A_log, "A_log", (heads,)),
                             (dt_bias, "dt_bias", (heads,))) + (((o_norm, "o_norm", (dv,)),) if o_norm is not None else ()):
        require_shape(arg, shape, what)
        require_dtype(arg, np.float32, what)
    host_indptr, dev_indptr = host_and_device(be, col_indptr, "col_indptr")
    require_indptr(host_indptr, "col_indptr", cols)
    B = host_indptr.shape[0] - 1
    host_count = dev_count = None
    if col_count is not None:
        host_count, dev_count = host_and_device(be, col_count, "col_count")
        require_shape(host_count, (B,), "col_count")
        require_dtype(host_count, np.int32, "col_count")
        bad = np.flatnonzero((host_count < 0) | (host_count > np.diff(host_indptr)))
        if bad.size:
            raise CapacityError(f"col_count[{bad[0]}]={int(host_count[bad[0]])} is outside [0, "
                                f"{int(np.diff(host_indptr)[bad[0]])}], the columns of session {bad[0]}")
    commit = bool(commit)
    states = as_table(be, states, "states", count=B, shape=(heads, dv, dk), dtype=np.float32, writable=commit,
                      align=16)
    conv_windows = as_table(be, conv_windows, "conv_windows", count=B, shape=(C, WINDOW), dtype=np.float32,
                            writable=commit)
    if want_out and out is None:
        out = be.xp.empty((cols, heads, dv), be.xp.float32)
    outputs = [(out, "out", (cols, heads, dv), 4)] if want_out else []
    if state_ckpt is not None:
        outputs.append((state_ckpt, "state_ckpt", (cols, heads, dv, dk), 16))
    if conv_ckpt is not None:
        outputs.append((conv_ckpt, "conv_ckpt", (cols, C, WINDOW), 4))
    for arg, what, shape, align in outputs:
        require_tensor(be, arg, what, shape, align=align)
    run = np.diff(host_indptr) if host_count is None else host_count
    if be.kernels is None:
        gdn_layer_ref(proj, layout, conv_weight, A_log, dt_bias, list(states.arrays), list(conv_windows.arrays),
                      host_indptr, heads, dk, dv, out if want_out else None, state_ckpt, conv_ckpt, k_heads, commit,
                      host_count, o_norm, eps)
    elif run.any():
        group, slices = heads // k_heads, -(-dv // rows)
        tickets = None  # [B k_heads: the key heads' windows | B heads: the gated norms], zero at rest
        if commit and group * slices > 1 or o_norm is not None and want_out and slices > 1:
            n = B * (k_heads + heads)
            tickets = fixed(be, ws, f"gdn.tickets.{n}", (n,), np.uint32, zero=True) if ws is not None \
                else rowsplit.scratch(be, n)[0]
        be.kernels.get_function(name)(
            (heads * slices, B), (threads,),
            (be.xp.ascontiguousarray(proj), np.int64(width), np.int32(layout.mixed), np.int32(layout.a),
             np.int32(layout.b), np.int32(layout.z), conv_weight, A_log, dt_bias, o_norm, np.float32(eps),
             states.device, conv_windows.device, dev_indptr, dev_count, np.int32(heads), np.int32(k_heads),
             np.int32(dv), np.int32(rows), out if want_out else None, state_ckpt, conv_ckpt, tickets,
             np.int32(commit)),
            shared_mem=smem)
    if run.any():
        moved = scan_bytes(int(np.count_nonzero(run)), int(run.sum()), heads, dk, dv, k_heads,
                           checkpoints=state_ckpt is not None, commit=commit)
        profile.moved("state", moved["state"])
        profile.moved("checkpoints", moved["checkpoints"])
    return out


def scan_smem(dk: int, rows: int) -> int:
    """The fused scan's dynamic shared memory for a block of `rows` state rows: a column's q, k and
    the rows' v, each of those channels' window and conv weights."""
    nch = 2 * dk + rows
    return 4 * nch * (1 + WINDOW + TAPS)


def scan_bytes(sessions: int, cols: int, heads: int, dk: int, dv: int, k_heads: int | None = None, *,
               checkpoints: bool = False, commit: bool = True, gated: bool = False) -> dict:
    """Bytes one gdn_layer call moves, by kind: the inputs and outputs of its columns ("columns":
    mixed, a, b, z when `gated`, out), the recurrent state and conv window read and (with commit)
    written ("state"), and the per-column checkpoints ("checkpoints"). The op reports the state and
    checkpoints through dspark.profile.moved; profiling/perf_model.py prices them all."""
    C = channels(heads, dk, dv, k_heads)
    state = heads * dv * dk + C * WINDOW  # floats per session
    return {"columns": 4 * cols * (C + 2 * heads + heads * dv * (2 if gated else 1)),
            "state": 4 * sessions * state * (2 if commit else 1),
            "checkpoints": 4 * cols * state if checkpoints else 0}
