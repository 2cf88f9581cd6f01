"""Row argmax, the fused greedy accept and the Markov chain (kernels: csrc/argmax.cu).

Ties go to the lowest index. A NaN is never chosen: it is flagged per row and the op raises
NonFiniteError naming the row. Given a `nan_flag` output, an op writes the flags there instead
and reads nothing back: the caller checks them at its own device->host synchronisation
(`raise_on_nan`), so a round that chains several ops waits on the device once. The NumPy
functions here are the reference the kernels are tested against, and the numpy backend's
implementation.

The kernels split each row across ceil(V / 8192) CTAs and merge exactly (dspark.ops.rowsplit);
markov_chain, whose entries each read r rows of w2, across ceil(V / 1024) (MARKOV_SLICE). An argmax
is exact in any split, so the slices change no result. `argmax_plan`, `greedy_accept_plan` and
`markov_chain_plan` give their launches and bytes for given shapes without running anything.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import suffix, to_f32
from ..errors import NonFiniteError, ShapeError
from ..arrays import adopt
from . import rowsplit
from .checks import Staged, host_and_device, require_dtype, require_indptr, require_ndim, require_shape
from .rowsplit import PART_WORDS, Launch, Plan, splits, threads
from .workspace import fixed

MARKOV_SLICE = 1024   # kMarkovSlice: markov_chain's entries per CTA (each reads r rows of w2)


def markov_splits(vocab: int) -> int:
    """markov_chain's CTAs per row: ceil(V / MARKOV_SLICE), at least 1."""
    return max(1, -(-int(vocab) // MARKOV_SLICE))


def markov_threads(vocab: int) -> int:
    """markov_chain's threads per CTA: a warp per 128 entries of its slice, 1 to 8 warps."""
    return 32 * min(rowsplit.MAX_THREADS // 32, max(1, -(-min(int(vocab), MARKOV_SLICE) // 128)))


# ---- NumPy reference ------------------------------------------------------------------------
def argmax_rows_ref(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index [rows] int32, nan_flag [rows] int32); index -1 only for an all-NaN row."""
    x = to_f32(logits)
    nan = np.isnan(x)
    idx = np.where(nan, -np.inf, x).argmax(axis=1).astype(np.int32) if x.shape[1] else np.full(x.shape[0], -1, np.int32)
    idx[nan.all(axis=1)] = -1
    return idx, nan.any(axis=1).astype(np.int32)


def greedy_accept_ref(logits, cand, col_indptr) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(m [B], next [B], nan_flag [B]); walks each session's columns until the first mismatch."""
    B = len(col_indptr) - 1
    m = np.full(B, -1, np.int32)
    nxt = np.full(B, -1, np.int32)
    flag = np.zeros(B, np.int32)
    for b in range(B):
        c0, c1 = int(col_indptr[b]), int(col_indptr[b + 1])
        for j in range(c1 - c0):
            idx, nan = argmax_rows_ref(logits[c0 + j : c0 + j + 1])
            flag[b] |= nan[0]
            if j == c1 - c0 - 1 or idx[0] != cand[c0 + j + 1]:
                m[b], nxt[b] = j, idx[0]
                break
    return m, nxt, flag


# ---- launch plans ---------------------------------------------------------------------------
I32, U64 = 4, 8


def _part_bytes(ctas: int, S: int) -> int:
    """Partials written and read back by the last CTAs (none when a row is one CTA)."""
    return ctas * PART_WORDS * U64 if S > 1 else 0


def argmax_plan(rows: int, vocab: int, itemsize: int = 4) -> Plan:
    """argmax_rows over logits [rows, V] of `itemsize`-byte entries: one launch, rows * S CTAs."""
    S = splits(vocab)
    ctas = rows * S
    row_bytes = rows * vocab * itemsize
    return Plan("argmax_rows", rows, vocab, S, (Launch("argmax_rows", ctas, threads(vocab)),),
                bytes_read=row_bytes + _part_bytes(ctas, S), bytes_written=2 * rows * I32 + _part_bytes(ctas, S),
                min_bytes=row_bytes + rows * I32)


def greedy_accept_plan(sessions: int, cols: int, vocab: int, itemsize: int = 4) -> Plan:
    """greedy_accept over `cols` verify columns of `sessions` sessions: one launch, cols * S CTAs
    (every column's argmax at once; the walk reads the merged partials). min_bytes assumes a
    full accept (every column read)."""
    S = splits(vocab)
    ctas = cols * S
    col_bytes = cols * vocab * itemsize
    small = cols * I32 + (sessions + 1) * I32
    return Plan("greedy_accept", cols, vocab, S, (Launch("greedy_accept", ctas, threads(vocab)),),
                bytes_read=col_bytes + small + ctas * PART_WORDS * U64,
                bytes_written=3 * sessions * I32 + ctas * PART_WORDS * U64,
                min_bytes=col_bytes + small + 2 * sessions * I32)


def markov_chain_plan(sessions: int, nd: int, vocab: int, rank: int, itemsize: int = 4) -> Plan:
    """markov_chain over nd slots of `sessions` sessions: nd launches of sessions * S CTAs (S =
    markov_splits(V); the slots are serial), or one launch of `sessions` CTAs looping over the slots
    when S = 1. Every slot reads all of w2 [r, V] (from L2 after the first)."""
    S = markov_splits(vocab)
    t, smem = markov_threads(vocab), 4 * rank
    if S == 1:
        launches = (Launch("markov_chain", sessions, t, smem, passes=nd),)
    else:
        launches = tuple(Launch("markov_chain", sessions * S, t, smem) for _ in range(nd))
    slot_bytes = sessions * nd * vocab * itemsize
    w_bytes = sessions * nd * (rank * vocab + rank) * 4
    parts = _part_bytes(sessions * nd * S, S)
    return Plan("markov_chain", sessions * nd, vocab, S, launches,
                bytes_read=slot_bytes + w_bytes + sessions * I32 + parts,
                bytes_written=sessions * (nd + 1) * I32 + parts,
                min_bytes=slot_bytes + rank * vocab * 4 + sessions * nd * rank * 4 + sessions * (nd + 2) * I32,
                notes={"flops": 2 * sessions * nd * rank * vocab})


def raise_on_nan(flag, what: str = "logits", unit: str = "row") -> None:
    """NonFiniteError naming the first flagged `unit` of host flags [n] (a deferred check)."""
    bad = np.flatnonzero(np.asarray(flag))
    if bad.size:
        raise NonFiniteError(f"{what}: {unit} {bad[0]} contains NaN ({bad.size} {unit}s in all)")


def _flag_out(be, nan_flag, n: int):
    """The op's NaN flags: the caller's `nan_flag` [n] int32 (checked later by the caller), or a
    fresh array the op reads back itself."""
    if nan_flag is None:
        return be.xp.empty(n, be.xp.int32)
    require_shape(nan_flag, (n,), "nan_flag")
    require_dtype(nan_flag, np.int32, "nan_flag")
    return nan_flag


def _check_or_defer(be, flag, deferred: bool, unit: str) -> None:
    if not deferred:
        raise_on_nan(be.to_host(flag), "logits", unit)


def argmax_rows(be, logits, out=None, nan_flag=None, ws=None):
    """Row argmax of `logits` [rows, V] (f32/f16/bf16) -> int32 [rows]. With `nan_flag` (int32
    [rows]) the NaN flags go there unread (module doc); otherwise a NaN raises here. `ws`: the
    workspace of the partials and tickets (dspark.ops.workspace)."""
    logits, out, nan_flag = adopt(be, logits=logits, out=out, nan_flag=nan_flag, writes=("out", "nan_flag"))
    require_ndim(logits, 2, "logits", "[rows, V]")
    suf = suffix(logits.dtype, "logits")
    rows, vocab = logits.shape
    if out is None:
        out = be.xp.empty(rows, be.xp.int32)
    require_shape(out, (rows,), "out")
    require_dtype(out, np.int32, "out")
    deferred = nan_flag is not None
    flag = _flag_out(be, nan_flag, rows)
    if be.kernels is None:
        idx, f = argmax_rows_ref(logits)
        out[...], flag[...] = idx, f
    else:
        xp = be.xp
        if rows:
            plan = argmax_plan(rows, vocab, logits.dtype.itemsize)
            (run,) = plan.launches
            part = fixed(be, ws, f"argmax.part.{run.ctas}", (run.ctas * PART_WORDS,), np.uint64)
            tickets, _ = rowsplit.scratch(be, rows, ws=ws)
            rowsplit.launch(be, f"argmax_rows_{suf}", run.ctas, run.threads,
                            (logits, np.int32(rows), np.int32(vocab), out, flag, part, tickets))
    _check_or_defer(be, flag, deferred, "row")
    return out


def greedy_accept(be, logits, cand, col_indptr, m_out=None, next_out=None, nan_flag=None, ws=None):
    """Greedy accept over ragged verify columns -> (m [B], next [B]) int32.

    `cand` [cols] holds each session's [anchor, d_1 .. d_{vt-1}]; `logits` [cols, V] its
    verify columns; `col_indptr` [B+1] splits the columns by session (a host array costs no
    device->host copy: the op validates it on the host and uploads it). With `nan_flag` (int32
    [B]) the NaN flags go there unread; otherwise a NaN raises here. `cand` may be Staged (host
    and device views of one upload). `ws`: the workspace of the partials and tickets.
    """
    staged_cand = cand if isinstance(cand, Staged) else None
    logits, cand, col_indptr, m_out, next_out, nan_flag = adopt(
        be, logits=logits, cand=None if staged_cand else cand, col_indptr=col_indptr, m_out=m_out, next_out=next_out,
        nan_flag=nan_flag, writes=("m_out", "next_out", "nan_flag"))
    require_ndim(logits, 2, "logits", "[cols, V]")
    suf = suffix(logits.dtype, "logits")
    cols, vocab = logits.shape
    host_cand, cand = host_and_device(be, staged_cand, "cand") if staged_cand else (cand, cand)
    require_ndim(host_cand, 1, "cand", "[cols]")
    require_dtype(host_cand, np.int32, "cand")
    require_shape(host_cand, (cols,), "cand")
    host_indptr, col_indptr = host_and_device(be, col_indptr, "col_indptr")
    require_indptr(host_indptr, "col_indptr", cols)
    B = host_indptr.shape[0] - 1
    xp = be.xp
    m_out = xp.empty(B, xp.int32) if m_out is None else m_out
    next_out = xp.empty(B, xp.int32) if next_out is None else next_out
    for name, a in (("m_out", m_out), ("next_out", next_out)):
        require_shape(a, (B,), name)
        require_dtype(a, np.int32, name)
    deferred = nan_flag is not None
    flag = _flag_out(be, nan_flag, B)
    if be.kernels is None:
        m, nxt, f = greedy_accept_ref(logits, host_cand, host_indptr)
        m_out[...], next_out[...], flag[...] = m, nxt, f
    else:
        if B and not cols:  # no columns, no CTA: every session gets m = next = -1
            m_out[...], next_out[...], flag[...] = -1, -1, 0
        elif B:
            plan = greedy_accept_plan(B, cols, vocab, logits.dtype.itemsize)
            (run,) = plan.launches
            part = fixed(be, ws, f"argmax.part.{run.ctas}", (run.ctas * PART_WORDS,), np.uint64)
            tickets, _ = rowsplit.scratch(be, B, ws=ws)
            rowsplit.launch(be, f"greedy_accept_{suf}", run.ctas, run.threads,
                            (logits, cand, col_indptr, np.int32(B), np.int32(vocab), m_out, next_out,
                             flag, part, tickets))
    _check_or_defer(be, flag, deferred, "session")
    return m_out, next_out


def markov_bias_ref(w1, w2, prev) -> np.ndarray:
    """w2^T w1[prev] [n, V] as the kernels sum it: running sums over the rank in increasing order
    (accumulate is sequential), one rounded multiply and add at a time; "+ 0" turns an all-(-0)
    sum into the +0 of the kernels' 0-initialised accumulator."""
    w1, w2 = np.asarray(w1, np.float32), np.asarray(w2, np.float32)
    prev = np.asarray(prev, np.int64)
    if w1.shape[1] == 0:
        return np.zeros((len(prev), w2.shape[1]), np.float32)
    return np.add.accumulate(w1[prev][:, :, None] * w2[None], axis=1)[:, -1] + np.float32(0)


def markov_chain_ref(logits, w1, w2, anchors, nd: int) -> tuple[np.ndarray, np.ndarray]:
    """(drafts [B, nd] int32, nan_flag [B] int32): x_k = argmax(logits_k + w2^T w1[x_{k-1}]).

    The bias is summed over the rank in increasing order, one rounded multiply and add at a
    time, exactly as the kernel does, so the argmax agrees bit for bit."""
    B = len(anchors)
    x = to_f32(logits).reshape(B, nd, -1)
    drafts = np.zeros((B, nd), np.int32)
    flag = np.zeros(B, np.int32)
    prev = np.asarray(anchors, np.int64)
    for k in range(nd):
        idx, nan = argmax_rows_ref(x[:, k] + markov_bias_ref(w1, w2, prev))
        drafts[:, k] = idx
        flag |= nan
        prev = np.maximum(idx, 0)
    return drafts, flag


def markov_chain(be, logits, w1, w2, anchors, nd: int, out=None, nan_flag=None, ws=None):
    """The drafter's greedy Markov chain over slot logits [B*nd, V] -> drafts [B, nd] int32.
    With `nan_flag` (int32 [B]) the NaN flags go there unread; otherwise a NaN raises here.
    anchors int32 [B]: host or Staged (validated on the host, read by the kernel from the device).
    `ws`: the workspace of the partials and tickets."""
    staged_anchors = anchors if isinstance(anchors, Staged) else None
    logits, w1, w2, anchors, out, nan_flag = adopt(be, logits=logits, w1=w1, w2=w2,
                                                   anchors=None if staged_anchors else anchors, out=out,
                                                   nan_flag=nan_flag, writes=("out", "nan_flag"), host=("anchors",))
    require_ndim(logits, 2, "logits", "[B*nd, V]")
    suf = suffix(logits.dtype, "logits")
    anchors, dev_anchors = (host_and_device(be, staged_anchors, "anchors") if staged_anchors
                            else (np.asarray(anchors, np.int32), None))
    anchors = np.asarray(anchors, np.int32)
    B, vocab = anchors.shape[0], logits.shape[1]
    require_shape(logits, (B * nd, vocab), "logits")
    require_ndim(w1, 2, "w1", "[V, r]")
    rank = w1.shape[1]
    require_shape(w1, (vocab, rank), "w1")
    require_shape(w2, (rank, vocab), "w2")
    require_dtype(w1, np.float32, "w1")
    require_dtype(w2, np.float32, "w2")
    if np.any((anchors < 0) | (anchors >= vocab)):
        raise ShapeError(f"anchors must lie in [0, {vocab}), got {anchors.tolist()}")
    xp = be.xp
    out = xp.empty((B, nd), xp.int32) if out is None else out
    require_shape(out, (B, nd), "out")
    require_dtype(out, np.int32, "out")
    deferred = nan_flag is not None
    flag = _flag_out(be, nan_flag, B)
    if be.kernels is None:
        drafts, f = markov_chain_ref(logits, w1, w2, anchors, nd)
        out[...], flag[...] = drafts, f
    else:
        if B and not nd:
            flag[...] = 0
        if B and nd:
            plan = markov_chain_plan(B, nd, vocab, rank, logits.dtype.itemsize)
            part = fixed(be, ws, f"argmax.part.{B * plan.splits}", (B * plan.splits * PART_WORDS,), np.uint64)
            tickets, _ = rowsplit.scratch(be, B, ws=ws)
            dev_anchors = xp.asarray(anchors) if dev_anchors is None else dev_anchors
            for k, run in enumerate(plan.launches):
                rowsplit.launch(be, f"markov_chain_{suf}", run.ctas, run.threads,
                                (logits, w1, w2, dev_anchors, np.int32(nd), np.int32(vocab), np.int32(rank), out,
                                 flag, part, tickets, np.int32(k if plan.splits > 1 else -1)),
                                shared_mem=run.shared_mem)
    _check_or_defer(be, flag, deferred, "session")
    return out
