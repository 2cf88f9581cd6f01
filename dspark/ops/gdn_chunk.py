"""The gated delta rule of a prompt pass in chunks of 64 (kernels: csrc/gdn_chunk.cu).

The WY (UT) form flash-linear-attention's chunk_gated_delta_rule and transformers'
torch_chunk_gated_delta_rule compute: within a chunk, the delta rule's updates condense into a few
matrix products (tensor cores for 16-bit operands); only the state between chunks is sequential.
Verify and decode keep the token-by-token scan (dspark.ops.gdn), which this pass equals within
CHUNK_TOLERANCE.

Chunks sit on a fixed absolute grid: chunk c holds positions [64 c, 64 c + 64). A session's pass
starting at a position inside a chunk recomputes that chunk from its start: the cache keeps the state
at the chunk's start (`chunk_states`) and the chunk's earlier inputs (`tails`: per row its conv
outputs x [C], a [H] and b [H], TAIL_WIDTH floats). So a prompt split anywhere (any pass length, a
prefix capture that ends inside a chunk, a resumed restore) gives bitwise the outputs and state of
one pass. `tail_lens[b]` is pos % 64 of session b, whose chunk state and tail hold its chunk so
far; a cache whose state a decode or verify moved since has no such tail, and the trunk runs the
sequential scan up to the next chunk boundary first (dspark.models.trunk).

Operands: `dtype` f32 (fmaf chains; the CPU-default f32 models) or the trunk's 16-bit weight type
(operands rounded to it, f32 accumulation, mma.sync), the same choice the GEMM makes for them.

`gdn_chunk_ref` is the NumPy twin: the same chunks, gates, masks and rounding points, products
summed in float64 (the kernels: MMA or fmaf chains), within REF_TOLERANCE of the kernels. The
numpy backend's prompt passes run the sequential scan (dspark.ops.gdn): on the CPU path it is exact
and fast; this op on numpy runs the twin, for tests.
"""

from __future__ import annotations

import numpy as np

from .. import profile
from ..arrays import adopt
from ..dtypes import BF16
from ..errors import CapacityError, DTypeError, ShapeError
from .checks import require_shape
from .gdn import SUPPORTED_DK, WINDOW, channels, check_layer_inputs, conv_silu_ref, conv_windows_of, gdn_gates_ref, \
    l2norm_ref
from .snapshot import require_tensor
from .tables import PointerTable, as_table

F32 = np.float32
CHUNK = 64               # tokens per chunk; chunks sit at absolute positions [64 c, 64 c + 64)
SLICE = 32               # kChunkSlice: state rows per CTA of the state walk
THREADS = 128            # kChunkThreads
CONV_COLS = 64           # kConvCols: columns per thread of gdn_conv_rows_f32
SOLVE_SCRATCH = 768 * 4       # chunk_solve's scratch, bytes
MAX_SHARED_MEM = 163 * 1024  # sm_80's per-CTA limit: the chunk kernels run on A100 and H100/H200 alike
DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)
# The pass against the sequential scan and transformers' chunked form, relative to the largest
# |output| (|state| for the state): f32 operands sum in another order; 16-bit ones are rounded. At
# decays to e^-300 a row, the chunk's cumulative gate sum (f32, as the peers keep it) reaches 2e4, whose
# ulp of 2e-3 moves exp(G_i - G_j) by that much: up to 2.5e-4 from an f64 recurrence over 200 seeds.
CHUNK_TOLERANCE = {np.dtype(np.float32): 5e-4, np.dtype(np.float16): 5e-3, BF16: 2e-2}
REF_TOLERANCE = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3, BF16: 2e-2}  # the kernels vs their twin


def tail_width(heads: int, dk: int, dv: int, k_heads: int | None = None) -> int:
    """Floats per tail row: conv outputs [C], a [H], b [H]."""
    return channels(heads, dk, dv, k_heads) + 2 * heads


def _pad(itemsize: int) -> int:
    return 16 // itemsize


def prep_shared_mem(dk: int, dv: int, itemsize: int) -> int:
    """Dynamic shared memory of gdn_chunk_prep (ChunkPrepLayout in csrc/gdn_chunk.cu): the gates; X
    (16-bit: q, k f32, then A, T f32 and the solve's scratch, then T and beta v in E; f32: A, T and
    T again); Y (q, k in E, then v f32 as copied); (beta gam) k in E."""
    e, dvp, pad = itemsize, -(-dv // 16) * 16, _pad(itemsize)
    at, te = 2 * CHUNK * (CHUNK + 1) * 4, CHUNK * (CHUNK + pad) * e
    x = at + te if e == 4 else max(2 * CHUNK * (dk + 4) * 4, at + SOLVE_SCRATCH, te + CHUNK * (dvp + pad) * e)
    y = max(2 * CHUNK * (dk + pad) * e, CHUNK * (dvp + 4) * 4)
    return 4 * CHUNK * 4 + x + y + CHUNK * (dk + pad) * e


def state_shared_mem(dk: int, itemsize: int) -> int:
    """Dynamic shared memory of gdn_chunk_state (ChunkStateLayout; the state itself is in registers)."""
    e, stages = itemsize, 2 if itemsize == 2 else 1
    lde, ldp, ldv = dk + _pad(e), CHUNK + _pad(e), SLICE + _pad(e)
    stage = (3 * CHUNK * lde + CHUNK * ldp) * e + CHUNK * SLICE * 4
    return SLICE * lde * e + stages * stage + CHUNK * ldv * e


def supported(dk: int, dv: int, dtype) -> bool:
    """Whether the chunk kernels take a layer of these head sizes (dk a scan size, dv a multiple of
    4 whose shared memory fits); the trunk scans sequentially otherwise."""
    e = np.dtype(dtype).itemsize
    return dk in SUPPORTED_DK and dv % 4 == 0 and max(prep_shared_mem(dk, dv, e), state_shared_mem(dk, e)) <= MAX_SHARED_MEM


# ---- NumPy reference -----------------------------------------------------------------------------------
def _rounder(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return lambda a: np.asarray(a, F32).astype(np.float64)
    return lambda a: np.asarray(a, F32).astype(dtype).astype(np.float64)


def gdn_chunk_ref(x, a, b, A_log, dt_bias, state, *, heads, dk, dv, k_heads=None, dtype=np.float32):
    """One session's rows (its tail, then its new columns) in chunks of 64 from `state` [H, dv, dk]
    at the first chunk's start: (o [rows, H, dv], the state after the last row, the state at the
    last chunk's start). x [rows, C] are conv outputs; a, b [rows, H]. The kernels' arithmetic
    with float64 sums (module doc)."""
    k_heads = heads if k_heads is None else k_heads
    rnd = _rounder(dtype)
    rows = x.shape[0]
    n = -(-rows // CHUNK) * CHUNK
    hk, group = k_heads * dk, heads // k_heads
    valid = np.arange(n) < rows
    xs = np.zeros((n, x.shape[1]), F32)
    xs[:rows] = x
    q = np.repeat(l2norm_ref(xs[:, :hk].reshape(n, k_heads, dk), F32(1) / np.sqrt(F32(dk))), group, axis=1)
    k = np.repeat(l2norm_ref(xs[:, hk : 2 * hk].reshape(n, k_heads, dk), F32(1)), group, axis=1)
    v = xs[:, 2 * hk :].reshape(n, heads, dv)
    ap, bp = np.zeros((n, heads), F32), np.zeros((n, heads), F32)
    ap[:rows], bp[:rows] = a, b
    alpha, beta = gdn_gates_ref(ap, bp, A_log, dt_bias)
    with np.errstate(over="ignore"):
        xg = ap + dt_bias
        g = -(np.exp(A_log) * np.where(xg > F32(20), xg, np.log1p(np.exp(xg))))
    g, beta = np.where(valid[:, None], g, F32(0)), np.where(valid[:, None], beta, F32(0))
    S = np.asarray(state, F32).copy()
    o = np.zeros((n, heads, dv), F32)
    last_start = S.copy()
    lower, strict = np.tril(np.ones((CHUNK, CHUNK), bool)), np.tril(np.ones((CHUNK, CHUNK), bool), -1)
    for c in range(n // CHUNK):
        rs = slice(CHUNK * c, CHUNK * c + CHUNK)
        last_start = S.copy()
        G = np.cumsum(g[rs], axis=0, dtype=F32).T                              # [H, 64]
        gam, dl = np.exp(G), np.exp(G[:, -1:] - G)
        Gam = np.exp(np.where(lower, G[:, :, None] - G[:, None, :], -np.inf)).astype(F32)  # [H, 64, 64], 0 above
        qc, kc, vc, bc = q[rs].transpose(1, 0, 2), k[rs].transpose(1, 0, 2), v[rs].transpose(1, 0, 2), beta[rs].T
        qE, kE = rnd(qc), rnd(kc)
        A = np.where(strict, (bc[:, :, None] * (kE @ kE.transpose(0, 2, 1)).astype(F32)) * Gam, 0).astype(F32)
        P = rnd(np.where(lower, (qE @ kE.transpose(0, 2, 1)).astype(F32) * Gam, 0))
        T = np.linalg.inv(np.eye(CHUNK) + A.astype(np.float64)).astype(F32)
        TE = rnd(T)
        U = (TE @ rnd(bc[:, :, None] * vc)).astype(F32)
        W = rnd(TE @ rnd((bc * gam)[:, :, None] * kc))
        Qt, Kt = rnd(gam[:, :, None] * qc), rnd(dl[:, :, None] * kc)
        SE = rnd(S)
        Vn = rnd(U - (W @ SE.transpose(0, 2, 1)).astype(F32))
        o[rs] = (Qt @ SE.transpose(0, 2, 1) + P @ Vn).astype(F32).transpose(1, 0, 2)
        S = (np.exp(G[:, -1])[:, None, None] * S + (Vn.transpose(0, 2, 1) @ Kt)).astype(F32)
    return o[:rows], S, last_start


def gdn_prompt_ref(mixed, a, b, conv_weight, A_log, dt_bias, states, conv_windows, chunk_states, tails, col_indptr,
                   tail_lens, heads, dk, dv, out, k_heads, dtype) -> None:
    """The op on host arrays, in place: the conv of the new columns, each session's chunks from its
    chunk state (tail) or live state (on the grid), the new tails."""
    k_heads = heads if k_heads is None else k_heads
    C = channels(heads, dk, dv, k_heads)
    total = int(col_indptr[-1])
    if not total:
        return
    x, windows = conv_silu_ref(conv_windows_of(np.stack(conv_windows), mixed, col_indptr), conv_weight, mixed[:total])
    for s in range(len(col_indptr) - 1):
        c0, c1 = int(col_indptr[s]), int(col_indptr[s + 1])
        if c0 == c1:
            continue
        t = int(tail_lens[s])
        tail = tails[s][:t]
        xs = np.concatenate([tail[:, :C], x[c0:c1]])
        as_ = np.concatenate([tail[:, C : C + heads], a[c0:c1]])
        bs = np.concatenate([tail[:, C + heads :], b[c0:c1]])
        o, S, last = gdn_chunk_ref(xs, as_, bs, A_log, dt_bias, chunk_states[s] if t else states[s], heads=heads,
                                   dk=dk, dv=dv, k_heads=k_heads, dtype=dtype)
        out[c0:c1] = o[t:]
        rows = xs.shape[0]
        if rows % CHUNK:
            chunk_states[s][...] = last
        states[s][...] = S
        keep = rows - rows // CHUNK * CHUNK
        tails[s][:keep] = np.concatenate([xs, as_, bs], axis=1)[rows - keep :]
        conv_windows[s][...] = windows[c1 - 1]


# ---- the op ---------------------------------------------------------------------------------------------
def chunk_indptr_of(col_indptr: np.ndarray, tail_lens: np.ndarray) -> np.ndarray:
    """[B+1] chunk offsets of a launch: session b has ceil((tail_lens[b] + columns) / 64) chunks, none
    without columns."""
    cols = np.diff(col_indptr)
    chunks = np.where(cols > 0, -(-(tail_lens + cols) // CHUNK), 0)
    return np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)


class ChunkSchedule:
    """A pass's chunks, the same for each of its gdn layers: per session the rows of its chunk already
    in the tail (`tail_lens`, host int32 [B], validated: 0..63) and its chunks' offsets, uploaded
    once (`device`: tail_lens then chunk_indptr) so the layers issue no copy of their own."""

    def __init__(self, be, col_indptr, tail_lens):
        self.col_indptr = np.asarray(col_indptr)
        B = self.col_indptr.shape[0] - 1
        tail_lens = np.asarray(tail_lens)
        require_shape(tail_lens, (B,), "tail_lens")
        if tail_lens.dtype.kind not in "iu" or np.any((tail_lens < 0) | (tail_lens >= CHUNK)):
            raise CapacityError(f"tail_lens={tail_lens.tolist()[:8]}: expected ints in [0, {CHUNK})")
        self.tail_lens = tail_lens.astype(np.int32)
        self.chunk_indptr = chunk_indptr_of(self.col_indptr, self.tail_lens)
        self.device = be.asarray(np.concatenate([self.tail_lens, self.chunk_indptr]))


def gdn_prompt(be, mixed, a, b, conv_weight, A_log, dt_bias, states, conv_windows, chunk_states, tails, col_indptr,
               tail_lens, *, heads, dk, dv, k_heads=None, dtype=np.float32, out=None):
    """A prompt pass of one gdn layer over each session's columns -> out [cols, H, dv] f32, with the
    live states and conv windows moved on (commit), and each session's chunk state and tail left
    describing its last chunk.

    Arguments as dspark.ops.gdn.gdn_scan's, plus: chunk_states (B arrays [H, dv, dk] f32, or a
    PointerTable): the state at the start of the chunk holding pos; tails (B arrays [64, C + 2H]
    f32): that chunk's rows before pos; tail_lens (host int32 [B], 0..63, or a ChunkSchedule made
    once for a pass's layers): pos % 64 of each session whose chunk state and tail hold its chunk so
    far (0: the live state sits on the grid); dtype: the products' operand type (module doc). dk a scan size, dv a multiple of 4 (`supported`)."""
    mixed, a, b, conv_weight, A_log, dt_bias, col_indptr, out = adopt(
        be, mixed=mixed, a=a, b=b, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias, col_indptr=col_indptr,
        out=out, writes=("out",))
    tables = {}
    for name, arrays in (("states", states), ("conv_windows", conv_windows), ("chunk_states", chunk_states),
                         ("tails", tails)):
        tables[name] = arrays if isinstance(arrays, PointerTable) else adopt(be, **{name: arrays}, writes=(name,))
    dtype = np.dtype(dtype)
    if dtype not in DTYPES:
        raise DTypeError(f"dtype={dtype}: expected float32, float16 or bfloat16")
    if not supported(dk, dv, dtype):
        raise ShapeError(f"dk={dk}, dv={dv}: the chunk kernels take dk in {SUPPORTED_DK} and dv a multiple of 4 "
                         f"whose shared memory fits")
    k_heads = heads if k_heads is None else int(k_heads)
    if not (isinstance(heads, (int, np.integer)) and heads >= 1 and k_heads >= 1 and heads % k_heads == 0):
        raise ShapeError(f"heads={heads!r}, k_heads={k_heads!r}: expected ints >= 1, k_heads dividing heads")
    C, cols, host_indptr, dev_indptr = check_layer_inputs(be, mixed, a, b, conv_weight, A_log, dt_bias, col_indptr,
                                                          heads, dk, dv, k_heads)
    B = host_indptr.shape[0] - 1
    sched = tail_lens if isinstance(tail_lens, ChunkSchedule) else ChunkSchedule(be, host_indptr, tail_lens)
    if not np.array_equal(sched.col_indptr, host_indptr):
        raise ShapeError("tail_lens: a ChunkSchedule made for other columns than col_indptr's")
    tail_lens = sched.tail_lens
    states = as_table(be, tables["states"], "states", count=B, shape=(heads, dv, dk), dtype=F32, writable=True, align=16)
    convs = as_table(be, tables["conv_windows"], "conv_windows", count=B, shape=(C, WINDOW), dtype=F32, writable=True)
    chunk_states = as_table(be, tables["chunk_states"], "chunk_states", count=B, shape=(heads, dv, dk), dtype=F32,
                            writable=True, align=16)
    tails = as_table(be, tables["tails"], "tails", count=B, shape=(CHUNK, C + 2 * heads), dtype=F32, writable=True)
    if out is None:
        out = be.xp.empty((cols, heads, dv), be.xp.float32)
    require_tensor(be, out, "out", (cols, heads, dv))
    if be.kernels is None:
        gdn_prompt_ref(mixed, a, b, conv_weight, A_log, dt_bias, list(states.arrays), list(convs.arrays),
                       list(chunk_states.arrays), list(tails.arrays), host_indptr, tail_lens, heads, dk, dv, out,
                       k_heads, dtype)
    elif cols:
        xp = be.xp
        n = int(sched.chunk_indptr[-1])
        dev_tails, dev_chunks = sched.device[:B], sched.device[B:]
        x = xp.empty((cols, C), xp.float32)  # the conv's SiLU outputs
        longest = int(np.diff(host_indptr).max())
        be.kernels.get_function("gdn_conv_rows_f32")(
            (-(-C // THREADS), -(-longest // CONV_COLS), B), (THREADS,),
            (mixed, conv_weight, convs.device, dev_indptr, np.int32(C), x))
        u_s = xp.empty((n, heads, CHUNK, dv), xp.float32)
        w_s, q_s, k_s = (xp.empty((n, heads, CHUNK, dk), dtype) for _ in range(3))
        p_s = xp.empty((n, heads, CHUNK, CHUNK), dtype)
        gl_s = xp.empty((n, heads), xp.float32)
        suf = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", BF16: "bf16"}[dtype]
        be.kernels.get_function(f"gdn_chunk_prep_{suf}_dk{dk}")(
            (n, heads), (THREADS,),
            (x, a, b, A_log, dt_bias, tails.device, dev_indptr, dev_tails, dev_chunks, np.int32(B), np.int32(heads),
             np.int32(k_heads), np.int32(dv), u_s, w_s, q_s, k_s, p_s, gl_s),
            shared_mem=prep_shared_mem(dk, dv, dtype.itemsize))
        be.kernels.get_function(f"gdn_chunk_state_{suf}_dk{dk}")(
            (-(-dv // SLICE), heads, B), (THREADS,),
            (mixed, x, a, b, convs.device, states.device, chunk_states.device, tails.device, dev_indptr, dev_tails,
             dev_chunks, np.int32(heads), np.int32(k_heads), np.int32(dv), u_s, w_s, q_s, k_s, p_s, gl_s, out),
            shared_mem=state_shared_mem(dk, dtype.itemsize))
    if cols:
        moved = prompt_bytes(int(np.count_nonzero(np.diff(host_indptr))), cols, heads, dk, dv, k_heads)
        profile.moved("state", moved)
    return out


def prompt_bytes(sessions: int, cols: int, heads: int, dk: int, dv: int, k_heads: int | None = None) -> int:
    """Recurrent-state bytes one prompt pass moves (dspark.profile's "state" kind): each session's
    state read and written, its chunk state and tail written, its conv window read and written."""
    C = channels(heads, dk, dv, k_heads)
    state = heads * dv * dk
    return 4 * sessions * (3 * state + CHUNK * (C + 2 * heads) + 2 * C * WINDOW)


def scratch_bytes(chunks: int, heads: int, dk: int, dv: int, itemsize: int) -> int:
    """Scratch of a launch over `chunks` chunks: U f32, W, Qt, Kt and P in the operand type, gl."""
    return chunks * heads * (CHUNK * dv * 4 + (3 * CHUNK * dk + CHUNK * CHUNK) * itemsize + 4)


def chunk_flops(heads: int, dk: int, dv: int) -> dict:
    """Multiply-add flops of one chunk of one layer: the prep (k k^T, q k^T, U, W) and the state walk
    (W S^T, Qt S^T, P Vn, Vn^T Kt), as the MMAs run them (whole 64-row chunks)."""
    prep = 2 * heads * CHUNK * CHUNK * (2 * dk + dv + dk)
    state = 2 * heads * CHUNK * (3 * dv * dk + CHUNK * dv)
    return {"prep": prep, "state": state, "solve": heads * CHUNK * CHUNK * CHUNK}


__all__ = ["CHUNK", "CHUNK_TOLERANCE", "REF_TOLERANCE", "chunk_flops", "gdn_chunk_ref", "gdn_prompt", "gdn_prompt_ref",
           "prompt_bytes", "scratch_bytes", "supported", "tail_width"]
