"""The coupled sampled accept (kernels: sample_filtered and pick_accept, csrc/sampling.cu).

Plain sampled decode picks the token at absolute position t as the Gumbel-max of its filtered
logit row: argmax over the kept i of d_i + G_i, with G drawn from the (seed, PICK, n = t) stream
(dspark.ops.sampling, method "gumbel"). A coupled speculative round uses that one pick on both
sides. The drafter proposes slot k as the pick of its own filtered row with the noise of position
pos + k + 1; the verify takes the target's pick of every column (column j's at pos + j + 1, the
position of the token after cand[j]). Draft d_{j+1} is accepted while it equals the target's pick
of column j; at the first disagreement, or after the last column, the target's pick is the next
token. Every emitted token is therefore the target's own pick at its position given the same
prefix: the stream is plain sampled decode's, token for token, whatever the drafter proposed, and
follows the filtered distribution because plain decode does.

`coupled_accept` runs the picks (one sample_filtered call over every verify column) and the walk
(`pick_accept`, a warp per session) on the device; nothing comes back until the caller's fetch.
The NumPy functions here are the reference the kernels are tested against, and the numpy
backend's implementation.
"""

from __future__ import annotations

import numpy as np

from ..arrays import adopt
from ..errors import TokenRangeError
from .checks import Staged, host_and_device, require_dtype, require_indptr, require_ndim, require_shape
from .rowsplit import Launch, Plan
from .workspace import fixed
from .sampling import (Filters, Streams, check_streams, prepare_rows, raise_rows, sample_filtered,
                       sample_filtered_ref, sample_plan)

PICK_ACCEPT_THREADS = 128    # 4 sessions (a warp each) per CTA
I32 = 4
PAD = -2                     # a padded verify column's candidate: equal to no pick (a bad row's pick is -1)


# ---- NumPy reference ----------------------------------------------------------------------------
def walk(agree, picks, col_indptr) -> tuple[np.ndarray, np.ndarray]:
    """Per session: m = its first column j < vt - 1 whose agree[c0 + j] is False (or vt - 1), next
    = picks[c0 + m]; m = next = -1 for a session without columns."""
    indptr = np.asarray(col_indptr, np.int64)
    B = len(indptr) - 1
    m, nxt = np.full(B, -1, np.int32), np.full(B, -1, np.int32)
    for b in range(B):
        c0, vt = int(indptr[b]), int(indptr[b + 1] - indptr[b])
        if vt:
            off = np.flatnonzero(~np.asarray(agree[c0 : c0 + vt - 1], bool))
            m[b] = int(off[0]) if off.size else vt - 1
            nxt[b] = picks[c0 + m[b]]
    return m, nxt


def following(cand) -> np.ndarray:
    """Column c's next candidate cand[c + 1] (-1 after the last; a session's last column is never
    compared)."""
    return np.append(np.asarray(cand, np.int64)[1:], -1)


def pick_accept_ref(picks, cand, col_indptr) -> tuple[np.ndarray, np.ndarray]:
    """Reference of pick_accept -> (m [B], next [B]) int32."""
    picks = np.asarray(picks, np.int64)
    return walk(picks == following(cand), picks, col_indptr)


def coupled_accept_ref(logits, cand, col_indptr, filters: Filters, streams: Streams) -> dict:
    """Reference of coupled_accept: the target's pick of every column (sample_filtered_ref,
    Gumbel-max), then the walk -> dict of picks, status [cols] and m, next [B]."""
    r = sample_filtered_ref(logits, filters, streams, "gumbel")
    picks = r["token"]
    agree = picks == following(cand)  # the draft is the target's own pick at its position
    m, nxt = walk(agree, picks, col_indptr)
    return {"picks": picks, "status": r["status"], "m": m, "next": nxt}


# ---- launch plan --------------------------------------------------------------------------------
def pick_accept_grid(sessions: int) -> int:
    return -(-sessions // (PICK_ACCEPT_THREADS // 32))


def coupled_accept_plan(sessions: int, cols: int, vocab: int, itemsize: int = 4, *, top_k: bool = False,
                        top_p: bool = False) -> Plan:
    """coupled_accept over `cols` verify columns of `sessions` sessions: sample_filtered's launches
    (Gumbel-max, no dist) over the columns, then one pick_accept launch."""
    picks = sample_plan(cols, vocab, itemsize, top_k=top_k, top_p=top_p)
    walk_bytes = 2 * cols * I32 + (sessions + 1) * I32
    run = Launch("pick_accept", pick_accept_grid(sessions), PICK_ACCEPT_THREADS)
    return Plan("coupled_accept", cols, vocab, picks.splits, picks.launches + (run,),
                bytes_read=picks.bytes_read + walk_bytes, bytes_written=picks.bytes_written + 2 * sessions * I32,
                min_bytes=picks.min_bytes + 2 * sessions * I32, notes=picks.notes)


# ---- ops ----------------------------------------------------------------------------------------
def _session_outs(be, B: int, m_out, next_out):
    xp = be.xp
    outs = [xp.empty(B, xp.int32) if o is None else o for o in (m_out, next_out)]
    for name, o in zip(("m_out", "next_out"), outs):
        require_shape(o, (B,), name)
        require_dtype(o, np.int32, name)
    return outs


def pick_accept(be, picks, cand, col_indptr, m_out=None, next_out=None):
    """The walk alone, over picks [cols] int32 -> (m [B], next [B]) int32. cand [cols] int32 and
    col_indptr [B+1] as in coupled_accept; picks are not range-checked (a bad row's pick is -1,
    which no candidate equals)."""
    picks, cand, col_indptr, m_out, next_out = adopt(be, picks=picks, cand=cand, col_indptr=col_indptr, m_out=m_out,
                                                     next_out=next_out, writes=("m_out", "next_out"))
    for name, a in (("picks", picks), ("cand", cand)):
        require_ndim(a, 1, name, "[cols]")
        require_dtype(a, np.int32, name)
    cols = picks.shape[0]
    require_shape(cand, (cols,), "cand")
    host_indptr, col_indptr = host_and_device(be, col_indptr)
    require_indptr(host_indptr, "col_indptr", cols)
    B = host_indptr.shape[0] - 1
    m_out, next_out = _session_outs(be, B, m_out, next_out)
    if be.kernels is None:
        m_out[...], next_out[...] = pick_accept_ref(picks, cand, host_indptr)
    elif B:
        be.kernels.get_function("pick_accept")((pick_accept_grid(B),), (PICK_ACCEPT_THREADS,),
                                               (picks, cand, col_indptr, np.int32(B), m_out, next_out))
    return m_out, next_out


def coupled_accept(be, logits, cand, col_indptr, filters: Filters, streams: Streams, m_out=None, next_out=None,
                   status_out=None, picks_out=None, ws=None):
    """The coupled accept for a ragged batch of sessions -> (m, next), int32 [B].

    `logits` [cols, V] (f32/f16/bf16) are the verify columns, `cand` [cols] int32 each session's
    [anchor, d_1 .. d_{vt-1}], `col_indptr` [B+1] splits the columns by session (a host array is
    validated on the host and uploaded). `filters` and `streams` are per column: the session's
    filters and its seed, with the PICK stream at the position of the token each column predicts.
    m = drafts accepted, next = the target's pick after them. `picks_out` (int32 [cols]) receives
    every column's pick. With `status_out` (int32 [cols]) the columns' row statuses go there
    unread (`raise_rows` at the caller's synchronisation); otherwise a bad column raises here.
    Nothing is read back from the device. A candidate PAD marks a column past a session's own
    width in a padded verify (dspark.graphs): never accepted. `ws`: the workspace of the picks and
    the sampling kernels' scratch (a recorded pass)."""
    logits, cand, col_indptr, filters, streams, m_out, next_out, status_out, picks_out = adopt(
        be, logits=logits, cand=cand, col_indptr=col_indptr, filters=filters, streams=streams, m_out=m_out,
        next_out=next_out, status_out=status_out, picks_out=picks_out,
        writes=("m_out", "next_out", "status_out", "picks_out"))
    require_ndim(logits, 2, "logits", "[cols, V]")
    cols, vocab = logits.shape
    host_cand, cand = host_and_device(be, cand)
    require_ndim(host_cand, 1, "cand", "[cols]")
    require_dtype(host_cand, np.int32, "cand")
    require_shape(host_cand, (cols,), "cand")
    bad = np.flatnonzero(((host_cand < 0) & (host_cand != PAD)) | (host_cand >= vocab))
    if bad.size:
        raise TokenRangeError(f"cand[{bad[0]}]={host_cand[bad[0]]} is outside the vocabulary [0, {vocab})")
    host_indptr, col_indptr = host_and_device(be, col_indptr)
    require_indptr(host_indptr, "col_indptr", cols)
    m_out, next_out = _session_outs(be, host_indptr.shape[0] - 1, m_out, next_out)
    xp = be.xp
    picks = fixed(be, ws, f"coupled.picks.{cols}", (cols,), np.int32) if picks_out is None else picks_out
    status = xp.empty(cols, xp.int32) if status_out is None else status_out
    if be.kernels is None:
        _, _, dev_filters, _ = prepare_rows(be, logits, filters)
        dev_streams = check_streams(be, streams, cols)
        for name, o in (("picks_out", picks), ("status_out", status)):
            require_shape(o, (cols,), name)
            require_dtype(o, np.int32, name)
        r = coupled_accept_ref(logits, host_cand, host_indptr, dev_filters, dev_streams)
        picks[...], status[...], m_out[...], next_out[...] = r["picks"], r["status"], r["m"], r["next"]
    else:
        # validates logits, filters, streams and the outputs; with status_out, reads nothing back
        sample_filtered(be, logits, filters, streams, "gumbel", token_out=picks, status_out=status, ws=ws)
        pick_accept(be, picks, cand, Staged(be, host_indptr, col_indptr), m_out, next_out)
    if status_out is None:
        raise_rows(be.to_host(status), "logits")
    return m_out, next_out
