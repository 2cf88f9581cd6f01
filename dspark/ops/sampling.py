"""Filtered sampling and the lossless speculative accept (kernels: csrc/sampling.cu).

Filtered distribution of a logit row x at temperature T > 0 (float32 math, dspark.philox's
bit-exact exp):

    d_i = (x_i - max x) * (1/T)      w_i = exp(d_i) in [0, 1]      W_i = floor(w_i * 2^32)

then, in this order (each step renormalises over what survived):

* top-k (0 < k < V): keep x_i >= the k-th largest logit; ties at the boundary are all kept.
* top-p (p < 1): sort the top-k survivors by w descending and keep the smallest prefix whose mass
  reaches p of theirs: sum(W) >= ceil(p * sum of survivors' W); ties at the boundary are kept.
* min-p (m > 0): keep w_i >= m, i.e. p_i >= m * p_max (the max always survives).
* always W_i > 0: an implicit floor at 2^-32 of the max, below anything a draw can resolve.

pi_i = W_i / S over the kept set, S = sum of the kept W. Masses are 64-bit integers, so every sum
is exact whatever the order, and the kernels' radix-select thresholds equal the sort-based ones
here bit for bit. T = 0 is greedy: the argmax (lowest index on ties) with probability 1.

Draws follow dspark.philox's stream layout with the row's (seed, counter, stream word):
Gumbel-max (argmax of d_i + G_i over the kept set, G_i from the row's per-token words) or inverse
CDF (the first kept i whose running sum of W exceeds floor(u * S / 2^32), u the row's word 0).

The speculative accept takes the drafter's filtered rows q and the target's filtered rows p and
accepts d_j while u_j * q_j(d_j) < p_j(d_j). On a reject it draws from norm(max(0, p_j - q_j)),
or from p_j when that has no mass (p == q up to rounding); on a full accept it draws the bonus
from the last target column. The emitted tokens then follow p exactly (lossless).

The NumPy functions here are the reference the kernels are tested against, and the numpy
backend's implementation; they are vectorised over rows and sessions.

The kernels split each row across ceil(V / 8192) CTAs and merge exactly (dspark.ops.rowsplit):
filtered sampling runs one launch per phase (scan, top-k digits, top-p digits, draw, dist) when a
row has several CTAs, one launch otherwise; the accept is one launch. `sample_plan` and
`accept_plan` give the launches and bytes for given shapes without running anything.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from .. import philox
from ..dtypes import suffix, to_f32
from ..errors import CapacityError, DsparkError, DTypeError, NonFiniteError, TokenRangeError
from ..philox import Tag
from ..arrays import adopt
from . import rowsplit, workspace
from .checks import host_and_device, require_dtype, require_indptr, require_ndim, require_shape
from .rowsplit import PART_WORDS, Launch, Plan, splits, threads

u32, u64, f32 = np.uint32, np.uint64, np.float32

MAX_VOCAB = 1 << 21           # keeps every integer mass below 2^53 (exact in float64)
METHODS = {"gumbel": 0, "inverse_cdf": 1}
METHOD_NONE = 2               # distribution only (filtered_probs)
ROW_OK, ROW_NON_FINITE, ROW_NO_FINITE = 0, 1, 2


class Source(enum.IntEnum):
    """Where speculative_accept's `next` token came from."""
    BONUS = 0      # full accept: drawn from the last target column
    RESIDUAL = 1   # reject at m: drawn from norm(max(0, p_m - q_m))
    FALLBACK = 2   # reject at m, residual without mass: drawn from p_m


class SamplingParamError(DsparkError, ValueError):
    """A sampling setting or stream word is outside its range."""


@dataclass(frozen=True)
class Filters:
    """Per-row filter settings, each an array of length rows (host or backend arrays).

    temperature float32 (0 = greedy), top_k int32 (0 or >= V = off), top_p float32 in (0, 1]
    (1 = off), min_p float32 in [0, 1] (0 = off)."""
    temperature: object
    top_k: object
    top_p: object
    min_p: object

    @classmethod
    def full(cls, rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> "Filters":
        """Host arrays; each setting is a scalar for every row or a sequence of length rows."""
        def col(v, dt):
            return np.ascontiguousarray(np.broadcast_to(np.asarray(v, dt), (rows,)))
        return cls(col(temperature, f32), col(top_k, np.int32), col(top_p, f32), col(min_p, f32))


@dataclass(frozen=True)
class Streams:
    """Where each row's draws come from: seed uint64, counter uint64 and stream word uint32
    (tag << 24 | slot), each of length rows. See dspark.philox for the layout."""
    seed: object
    counter: object
    stream: object

    @classmethod
    def full(cls, rows: int, seed, counter, tag: Tag, slot=0) -> "Streams":
        """Host arrays; seed, counter and slot are scalars or sequences of length rows."""
        def col(v, dt):
            return np.ascontiguousarray(np.broadcast_to(np.asarray(v, dt), (rows,)))
        return cls(col(seed, u64), col(counter, u64), col(philox.stream_word(int(tag), slot), u32))


# ---- integer masses and keys (the kernels' helpers, step by step) -----------------------------
def fixed(w) -> np.ndarray:
    """A weight in [0, 1] as a 2^-32 fixed-point integer (clamped first, NaN -> 0)."""
    w = np.asarray(w, f32)
    w = np.where(w > 0, np.where(w < 1, w, f32(1)), f32(0))
    return (w * f32(2.0**32)).astype(u64)


def ratio(w, total) -> np.ndarray:
    """float(w) / float(total) in float32, each conversion rounded once (as the kernels do)."""
    def to32(a):
        return np.asarray(a, u64).astype(np.float64).astype(f32)  # exact below 2^53, then one rounding
    with np.errstate(divide="ignore", invalid="ignore"):
        return to32(w) / to32(total)


def order_key(x) -> np.ndarray:
    """Order-preserving uint32 key of float32 values (no NaN); -0 ties with +0."""
    u = np.asarray(x, f32).view(u32)
    u = np.where(u == u32(0x80000000), u32(0), u)
    return np.where(u & u32(0x80000000), ~u, u | u32(0x80000000))


def mulhi32(total, x) -> np.ndarray:
    """floor(total * x / 2^32) for total < 2^53 and 32-bit x, exactly (the kernel's __umul64hi)."""
    total, x = np.asarray(total, u64), np.asarray(x, u32).astype(u64)
    return (total >> u64(32)) * x + (((total & u64(0xFFFFFFFF)) * x) >> u64(32))


def inverse_cdf(weights, x) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the first i whose running sum of weights [rows, V] (uint64) exceeds
    floor(x * S / 2^32), S the row total -> (token, S); token -1 when S = 0."""
    cum = np.cumsum(weights, axis=1, dtype=u64)
    total = cum[:, -1] if cum.shape[1] else np.zeros(cum.shape[0], u64)
    target = mulhi32(total, x)
    token = (cum <= target[:, None]).sum(axis=1).astype(np.int32)
    return np.where(total > 0, token, np.int32(-1)), total


# ---- NumPy reference: filtered sampling ---------------------------------------------------------
def _top_p_goal(p, survivors_mass):
    """ceil(p * mass of the top-k survivors), at least 1: top-p renormalises after top-k."""
    goal = np.ceil(p.astype(np.float64) * survivors_mass.astype(np.float64)).astype(u64)
    return np.maximum(goal, u64(1))


def _kth_largest(keys, k):
    """Per row, the k-th largest key (k in [1, V])."""
    s = np.sort(keys, axis=1)
    return np.take_along_axis(s, (keys.shape[1] - k)[:, None].astype(np.intp), axis=1)[:, 0]


def _top_p_threshold(w, in_k, p):
    """Per row, the largest weight bit pattern t such that the survivors with bits(w) >= t carry
    at least the top-p goal: the key where the descending cumulative mass first reaches it (ties
    at t are kept together)."""
    keys = np.where(in_k, w.view(u32), u32(0))
    goal = _top_p_goal(p, np.where(in_k, fixed(w), u64(0)).sum(axis=1, dtype=u64))
    desc = np.sort(keys, axis=1)[:, ::-1]
    cum = np.cumsum(fixed(desc.view(f32)), axis=1, dtype=u64)  # W is a function of the key
    pos = (cum < goal[:, None]).sum(axis=1)
    return np.take_along_axis(desc, pos[:, None], axis=1)[:, 0]


def filter_rows(x, filters) -> dict:
    """The filtered distributions of logit rows x [rows, V] (any storage dtype).

    Returns a dict of arrays over rows: status (ROW_*), greedy (bool), argmax, d (f32 [rows, V],
    the shifted scaled logits), kept (uint64 [rows, V]: W_i on the kept set, else 0) and total
    (uint64: S). Rows that are greedy or bad have kept = 0."""
    x = to_f32(x)
    rows, vocab = x.shape
    t = np.asarray(filters.temperature, f32)
    k = np.asarray(filters.top_k, np.int64)
    p = np.asarray(filters.top_p, f32)
    mp = np.asarray(filters.min_p, f32)

    bad = (np.isnan(x) | (x == np.inf)).any(axis=1)
    clean = np.where(bad[:, None], f32(0), x)
    argmax = clean.argmax(axis=1).astype(np.int32) if vocab else np.zeros(rows, np.int32)
    xmax = clean.max(axis=1) if vocab else np.full(rows, -np.inf, f32)
    status = np.where(bad, ROW_NON_FINITE, np.where(xmax == -np.inf, ROW_NO_FINITE, ROW_OK)).astype(np.int32)
    greedy = (status == ROW_OK) & ~(t > 0)
    live = (status == ROW_OK) & (t > 0)

    with np.errstate(divide="ignore", invalid="ignore"):
        inv_t = np.where(live, f32(1) / np.where(live, t, f32(1)), f32(0)).astype(f32)
        d = (clean - np.where(live, xmax, f32(0))[:, None]) * inv_t[:, None]
    d = np.where(live[:, None], d, f32(-np.inf)).astype(f32)
    w = philox.exp_f32(d)
    W = fixed(w)

    in_k = _in_top_k(clean, np.where(live, k, 0), vocab)
    keep = live[:, None] & (W > 0) & in_k
    topp = live & (p < 1)
    if topp.any():
        keep[topp] &= w[topp].view(u32) >= _top_p_threshold(w[topp], in_k[topp], p[topp])[:, None]
    if (mp > 0).any():  # w >= 0 everywhere
        keep &= w >= mp[:, None]
    kept = np.where(keep, W, u64(0))
    return {"status": status, "greedy": greedy, "argmax": argmax, "d": d, "kept": kept,
            "total": kept.sum(axis=1, dtype=u64)}


def _in_top_k(x, k, vocab):
    """The top-k set by logits alone (k outside (0, V) keeps everything)."""
    on = (k > 0) & (k < vocab)
    out = np.ones(x.shape, bool)
    if on.any():
        keys = order_key(x[on])
        out[on] = keys >= _kth_largest(keys, k[on])[:, None]
    return out


# Vocabularies up to this width draw whole rows of noise through the memo (philox.GumbelRows):
# there a row costs about what a few entries do, and a coupled round draws each row several times.
MEMO_VOCAB = 4096
GUMBEL_ROWS = philox.GumbelRows()


def draw_ahead(be, seed, counter, stream, vocab: int) -> None:
    """A hint that the rows (seed, counter, stream word) [rows] of a `vocab`-wide vocabulary will
    be drawn soon (a coupled round's positions): the host reference draws their noise now, in one
    batch; kernels draw their own, so with kernels this does nothing."""
    if be.kernels is None and vocab <= MEMO_VOCAB:
        GUMBEL_ROWS(seed, counter, stream, vocab)


def _gumbel_max(d, keep, seed, counter, stream):
    """argmax over kept i of d_i + G_i per row (first index on ties). Narrow rows take whole rows
    of noise from the memo; otherwise noise is drawn only where something is kept, like the
    kernel: per entry when few are, per row otherwise. The noise of an entry is the same either way."""
    if keep.shape[1] <= MEMO_VOCAB:
        score = np.where(keep, d + GUMBEL_ROWS(seed, counter, stream, keep.shape[1]), f32(-np.inf))
        return np.where(keep.any(axis=1), score.argmax(axis=1), -1)
    r, i = np.nonzero(keep)
    if 4 * len(r) < keep.size:
        noise = philox.gumbel(philox.draw_words(seed[r], counter[r], stream[r], i))
    else:
        noise = philox.gumbel(philox.row_words(seed, counter, stream, keep.shape[1])[r, i])
    score = np.full(keep.shape, -np.inf, f32)
    score[r, i] = d[r, i] + noise
    return np.where(keep.any(axis=1), score.argmax(axis=1), -1)


def sample_filtered_ref(x, filters, streams, method: str = "gumbel", with_dist: bool = False,
                        with_prob: bool = True) -> dict:
    """Reference of sample_filtered_<dt>: filter_rows' dict plus token, prob (and dist; no prob
    without `with_prob`)."""
    r = filter_rows(x, filters)
    rows, vocab = np.shape(x)
    kept, total = r["kept"], r["total"]
    live = (r["status"] == ROW_OK) & ~r["greedy"]
    token = np.where(r["greedy"], r["argmax"], np.int32(-1)).astype(np.int32)
    if live.any() and method == "gumbel":
        token[live] = _gumbel_max(r["d"][live], kept[live] > 0, *(np.asarray(a)[live] for a in (
            streams.seed, streams.counter, streams.stream)))
    elif live.any() and method == "inverse_cdf":
        x0 = philox.draw_words(np.asarray(streams.seed)[live], np.asarray(streams.counter)[live],
                               np.asarray(streams.stream)[live], 0)
        token[live] = inverse_cdf(kept[live], x0)[0]
    r["token"] = token
    if with_prob:
        prob = np.where(r["status"] == ROW_OK, np.where(r["greedy"], f32(1), f32(0)), f32(0)).astype(f32)
        picked = live & (token >= 0)
        if picked.any():
            w_tok = np.take_along_axis(kept[picked], token[picked][:, None].astype(np.intp), axis=1)[:, 0]
            prob[picked] = ratio(w_tok, total[picked])
        r["prob"] = prob
    if with_dist:
        dist = np.zeros((rows, vocab), f32)
        dist[live] = ratio(kept[live], total[live][:, None])
        g = np.flatnonzero(r["greedy"])
        dist[g, r["argmax"][g]] = 1
        r["dist"] = dist
    return r


# ---- NumPy reference: speculative accept --------------------------------------------------------
def _accepts(u, q_d, p_d):
    """The accept test of a draft d: u * q(d) < p(d), in float32."""
    return u * q_d < p_d


def _is_prob(v):
    return (v >= 0) & (v <= 1)


def speculative_accept_ref(drafts, draft_indptr, q, p, seed, counter) -> dict:
    """Reference of spec_accept_f32 -> dict of m, next, source, status over sessions."""
    indptr = np.asarray(draft_indptr, np.int64)
    start = indptr[:-1]
    drafts = np.asarray(drafts, np.int64)
    q, p = np.asarray(q, f32), np.asarray(p, f32)
    seed, counter = np.asarray(seed, u64), np.asarray(counter, u64)
    B = len(indptr) - 1
    nd = np.diff(indptr)
    sess = np.repeat(np.arange(B), nd)
    j = np.arange(len(drafts)) - indptr[sess]
    q_d = q[np.arange(len(drafts)), drafts]
    p_d = p[np.arange(len(drafts)) + sess, drafts]
    u = philox.uniform(philox.draw_words(seed[sess], counter[sess], philox.stream_word(Tag.ACCEPT, j), 0))
    reject = ~_accepts(u, q_d, p_d)
    m = nd.copy()
    np.minimum.at(m, sess[reject], j[reject])
    bad = np.zeros(B, bool)
    np.logical_or.at(bad, sess, ~(_is_prob(q_d) & _is_prob(p_d)))

    residual = m < nd
    prow = p[start + np.arange(B) + m]
    qrow = q[np.where(residual, start + m, 0)] if len(q) else np.zeros_like(prow)
    qrow = np.where(residual[:, None], qrow, f32(0))
    bad |= ~(_is_prob(prow) & (~residual[:, None] | _is_prob(qrow))).all(axis=1)
    weights = np.where(residual[:, None], fixed(prow - qrow), fixed(prow))
    fallback = residual & (weights.sum(axis=1, dtype=u64) == 0)
    weights[fallback] = fixed(prow[fallback])
    tag = np.where(residual, int(Tag.RESIDUAL), int(Tag.BONUS))
    x = philox.draw_words(seed, counter, philox.stream_word(tag, 0), 0)
    token, _ = inverse_cdf(weights, x)
    source = np.where(residual, np.where(fallback, Source.FALLBACK, Source.RESIDUAL), Source.BONUS)
    return {"m": m.astype(np.int32), "next": token, "source": source.astype(np.int32),
            "status": (bad | (token < 0)).astype(np.int32)}


def philox_random_ref(ctr, key) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Reference of philox_blocks: (bits, uniform, uniform_open, gumbel), each [n, 4]."""
    bits = philox.philox4x32(ctr, key)
    return bits, philox.uniform(bits), philox.uniform_open(bits), philox.gumbel(bits)


# ---- launch plans -------------------------------------------------------------------------------
PHILOX_THREADS, PHILOX_MAX_BLOCKS = 256, 1024
STATE_WORDS = 7               # kStateWords: a row's state between the phases of sample_filtered
PHASE_SCAN, PHASE_TOP_K, PHASE_TOP_P, PHASE_DRAW, PHASE_DIST, PHASE_ALL = 0, (1, 2), (3, 4, 5), 6, 7, -1
I32, F32, U64 = 4, 4, 8


def sample_phases(top_k: bool = False, top_p: bool = False, sampled: bool = True, dist: bool = False) -> list[int]:
    """The phases a call runs: the scan always; top-k's last two digits when some row has top-k on
    (its first rides on the scan); top-p's three when some row has it on; the draw when some row
    samples (T > 0; it also sums the mass dist needs); dist when asked."""
    return ([PHASE_SCAN] + (list(PHASE_TOP_K) if top_k else []) + (list(PHASE_TOP_P) if top_p else [])
            + ([PHASE_DRAW] if sampled else []) + ([PHASE_DIST] if dist else []))


def sample_plan(rows: int, vocab: int, itemsize: int = 4, *, top_k: bool = False, top_p: bool = False,
                method: str | None = "gumbel", dist: bool = False, sampled: bool = True) -> Plan:
    """sample_filtered (method None: filtered_probs) over logits [rows, V]: with S > 1 CTAs per
    row one launch of rows * S CTAs per phase (notes["phases"]), else one launch of `rows` CTAs
    running them all. Each phase reads the rows once; an inverse-CDF draw also walks one slice."""
    S = splits(vocab)
    phases = sample_phases(top_k, top_p, sampled, dist)
    walk = 1 / S if sampled and method == "inverse_cdf" else 0.0

    def passes(phase):
        return 0.0 if phase == PHASE_DIST and not dist else 1.0 + (walk if phase == PHASE_DRAW else 0.0)

    t = threads(vocab)
    if S == 1:
        launches = (Launch("sample_filtered", rows, t, passes=sum(passes(p) for p in phases)),)
    else:
        launches = tuple(Launch("sample_filtered", rows * S, t, passes=passes(p)) for p in phases)
    row_bytes = rows * vocab * itemsize
    dist_bytes = rows * vocab * F32 if dist else 0
    settings = rows * (4 * 4 + 2 * 8 + 4)  # temperature, top_k, top_p, min_p; seed, counter; stream
    outs = 3 * rows * I32
    state = rows * STATE_WORDS * U64 * len(phases)  # written by one phase, read by the next ones
    merges = [p for p in phases if p != PHASE_DIST] if S > 1 else []
    parts = len(merges) * rows * S * PART_WORDS * U64  # written by every CTA, read by the last
    radix = sum(p in PHASE_TOP_K or p in PHASE_TOP_P or (p == PHASE_SCAN and top_k) for p in merges)
    hist = radix * rows * rowsplit.RADIX_BINS * U64  # the last CTA reads a row's histogram, then zeroes it
    return Plan("sample_filtered", rows, vocab, S, launches,
                bytes_read=int(sum(launch.passes for launch in launches) * row_bytes) + settings + state + parts + hist,
                bytes_written=outs + dist_bytes + state + parts + hist,
                min_bytes=row_bytes + settings + outs + dist_bytes,
                notes={"phases": phases, "hist_atomics": "not counted: at most one per bin a CTA fills"})


def accept_plan(sessions: int, drafts: int, vocab: int) -> Plan:
    """spec_accept_f32 for `sessions` sessions of `drafts` drafts each: one launch of sessions * S
    CTAs; each reads its slice of one target row and (after a reject) one drafter row, and the
    last CTA of a session walks one slice of them again."""
    S = splits(vocab)
    ctas = sessions * S
    rows_read = 2 * sessions * vocab * F32  # the residual reads p_m and q_m; a bonus only p
    tests = sessions * drafts * 3 * I32 + (sessions + 1) * I32 + sessions * 2 * U64
    parts = ctas * PART_WORDS * U64 if S > 1 else 0
    return Plan("spec_accept", sessions, vocab, S, (Launch("spec_accept", ctas, threads(vocab), passes=1 + 1 / S),),
                bytes_read=int(rows_read * (1 + 1 / S)) + tests * S + parts,
                bytes_written=4 * sessions * I32 + parts,
                min_bytes=rows_read + tests + 4 * sessions * I32)


# ---- validation ---------------------------------------------------------------------------------
def _vector(be, a, rows: int, dtype, what: str) -> tuple[np.ndarray, object]:
    """(host copy, backend array) of a per-row setting, checked on the host. Host arrays (what
    Filters.full and Streams.full make) are uploaded, never read back: no wait on the device."""
    host, dev = host_and_device(be, a, what)
    require_ndim(host, 1, what, "[rows]")
    require_dtype(host, dtype, what)
    require_shape(host, (rows,), what)
    return host, dev


def _check_range(host, ok, what: str, expected: str) -> None:
    bad = np.flatnonzero(~ok)
    if bad.size:
        raise SamplingParamError(f"{what}[{bad[0]}]={host[bad[0]].item()!r} is outside {expected}")


def _check_filters(be, filters: Filters, rows: int) -> tuple[Filters, tuple]:
    """The filters on the backend, and host copies (temperature, top_k, top_p, min_p)."""
    (t, dt), (k, dk), (p, dp), (mp, dmp) = (_vector(be, filters.temperature, rows, f32, "temperature"),
                                            _vector(be, filters.top_k, rows, np.int32, "top_k"),
                                            _vector(be, filters.top_p, rows, f32, "top_p"),
                                            _vector(be, filters.min_p, rows, f32, "min_p"))
    f = Filters(dt, dk, dp, dmp)
    # a subnormal temperature would make 1/T infinite (and the max's weight 0 * inf)
    _check_range(t, np.isfinite(t) & ((t == 0) | (t >= np.finfo(f32).tiny)), "temperature",
                 "0 (greedy) or [2^-126, inf)")
    _check_range(k, k >= 0, "top_k", "[0, inf) (0 = off)")
    _check_range(p, (p > 0) & (p <= 1), "top_p", "(0, 1] (1 = off)")
    _check_range(mp, (mp >= 0) & (mp <= 1), "min_p", "[0, 1] (0 = off)")
    return f, (t, k, p, mp)


def check_streams(be, streams: Streams, rows: int) -> Streams:
    """The streams on the backend, each checked on the host (a bad tag or shape raises)."""
    (_, seed), (_, counter), (stream, dstream) = (_vector(be, streams.seed, rows, u64, "seed"),
                                                  _vector(be, streams.counter, rows, u64, "counter"),
                                                  _vector(be, streams.stream, rows, u32, "stream"))
    tag = stream >> u32(philox.SLOT_BITS)
    _check_range(tag, (tag >= min(Tag)) & (tag <= max(Tag)), "stream tag", f"the tags {[int(t) for t in Tag]}")
    return Streams(seed, counter, dstream)


def _check_vocab(vocab: int, what: str) -> None:
    if not 1 <= vocab <= MAX_VOCAB:
        raise CapacityError(f"{what} has {vocab} columns: expected a vocabulary in [1, {MAX_VOCAB}]")


def _out(be, out, shape, dtype, what: str):
    if out is None:
        return be.xp.empty(shape, dtype)
    require_shape(out, shape, what)
    require_dtype(out, dtype, what)
    return out


def raise_rows(status, what: str = "logits") -> None:
    """NonFiniteError naming the first bad row of host row statuses [rows] (ROW_*): the check
    sample_filtered and filtered_probs make, or their caller makes later with `status_out`."""
    status = np.asarray(status)
    for code, says in ((ROW_NON_FINITE, "contains NaN or +inf"), (ROW_NO_FINITE, "has no finite logit")):
        bad = np.flatnonzero(status == code)
        if bad.size:
            raise NonFiniteError(f"{what}: row {bad[0]} {says} ({bad.size} rows in all)")


def _status_out(be, status_out, rows: int):
    if status_out is None:
        return be.xp.empty(rows, be.xp.int32)
    require_shape(status_out, (rows,), "status_out")
    require_dtype(status_out, np.int32, "status_out")
    return status_out


# ---- ops ----------------------------------------------------------------------------------------
def _launch_filtered(be, logits, filters, streams, method_code, token, prob, dist, status, plan_flags, ws=None):
    rows, vocab = logits.shape
    if rows:
        plan = sample_plan(rows, vocab, logits.dtype.itemsize, **plan_flags)
        S = plan.splits
        state = workspace.fixed(be, ws, f"sample.state.{rows}", (rows * STATE_WORDS,), u64)
        part = workspace.fixed(be, ws, f"sample.part.{rows * S}", (rows * S * PART_WORDS,), u64)
        radix = S > 1 and (plan_flags["top_k"] or plan_flags["top_p"])
        tickets, hist = rowsplit.scratch(be, rows, rows if radix else 0, ws=ws)
        kernel = f"sample_filtered_{suffix(logits.dtype, 'logits')}"
        phases = plan.notes["phases"] if S > 1 else [PHASE_ALL]
        for phase, run in zip(phases, plan.launches):
            rowsplit.launch(be, kernel, run.ctas, run.threads,
                            (logits, np.int32(rows), np.int32(vocab), filters.temperature, filters.top_k,
                             filters.top_p, filters.min_p, streams.seed, streams.counter, streams.stream,
                             np.int32(method_code), token, prob, dist, status, state, part, tickets, hist,
                             np.int32(phase)))


def _plan_flags(filters_host, vocab: int, method: str | None, dist: bool) -> dict:
    t, k, p, _ = filters_host
    return dict(top_k=bool(((k > 0) & (k < vocab)).any()), top_p=bool((p < 1).any()), method=method, dist=dist,
                sampled=bool((t > 0).any()))


def prepare_rows(be, logits, filters):
    """Checks logit rows and their filters -> (rows, vocab, filters on the backend, host copies)."""
    require_ndim(logits, 2, "logits", "[rows, V]")
    suffix(logits.dtype, "logits")
    rows, vocab = logits.shape
    _check_vocab(vocab, "logits")
    return (rows, vocab, *_check_filters(be, filters, rows))


def sample_filtered(be, logits, filters: Filters, streams: Streams, method: str = "gumbel",
                    token_out=None, prob_out=None, dist_out=None, status_out=None, ws=None):
    """Draw one token per row of `logits` [rows, V] (f32/f16/bf16) from its filtered
    distribution -> (token int32 [rows], prob float32 [rows] = pi_token). `dist_out` float32
    [rows, V], when given, receives the filtered distributions (the rows the residual needs).
    With `status_out` (int32 [rows]) the row statuses go there unread and the caller checks them
    (`raise_rows`) at its own synchronisation; otherwise a bad row raises here. Host filter and
    stream arrays are checked on the host and uploaded: nothing is read back. `ws`: the workspace of
    the prob output and the kernels' state, partials and tickets (a recorded pass, whose filters and
    streams come Staged from its inputs block)."""
    logits, filters, streams, token_out, prob_out, dist_out, status_out = adopt(
        be, logits=logits, filters=filters, streams=streams, token_out=token_out, prob_out=prob_out,
        dist_out=dist_out, status_out=status_out, writes=("token_out", "prob_out", "dist_out", "status_out"))
    rows, vocab, filters, host = prepare_rows(be, logits, filters)
    streams = check_streams(be, streams, rows)
    if method not in METHODS:
        raise SamplingParamError(f"method={method!r}: expected one of {', '.join(METHODS)}")
    token = _out(be, token_out, (rows,), np.int32, "token_out")
    if prob_out is None and ws is not None:
        prob_out = workspace.fixed(be, ws, f"sample.prob.{rows}", (rows,), f32)
    prob = _out(be, prob_out, (rows,), f32, "prob_out")
    if dist_out is not None:
        require_shape(dist_out, (rows, vocab), "dist_out")
        require_dtype(dist_out, f32, "dist_out")
    status = _status_out(be, status_out, rows)
    if be.kernels is None:
        r = sample_filtered_ref(logits, filters, streams, method, with_dist=dist_out is not None)
        token[...], prob[...], status[...] = r["token"], r["prob"], r["status"]
        if dist_out is not None:
            ok = r["status"] == ROW_OK
            dist_out[ok] = r["dist"][ok]
    else:
        _launch_filtered(be, logits, filters, streams, METHODS[method], token, prob, dist_out, status,
                         _plan_flags(host, vocab, method, dist_out is not None), ws)
    if status_out is None:
        raise_rows(be.to_host(status), "logits")
    return token, prob


def filtered_probs(be, logits, filters: Filters, out=None, status_out=None):
    """The filtered distributions of `logits` [rows, V] -> float32 [rows, V] (no draw).
    `status_out`: as in sample_filtered."""
    logits, filters, out, status_out = adopt(be, logits=logits, filters=filters, out=out, status_out=status_out,
                                             writes=("out", "status_out"))
    rows, vocab, filters, host = prepare_rows(be, logits, filters)
    dist = _out(be, out, (rows, vocab), f32, "out")
    status = _status_out(be, status_out, rows)
    if be.kernels is None:
        r = sample_filtered_ref(logits, filters, None, method="none", with_dist=True)
        ok = r["status"] == ROW_OK
        dist[ok] = r["dist"][ok]
        status[...] = r["status"]
    else:
        xp = be.xp
        zeros = Streams(xp.zeros(rows, u64), xp.zeros(rows, u64), xp.zeros(rows, u32))
        _launch_filtered(be, logits, filters, zeros, METHOD_NONE, xp.empty(rows, xp.int32), xp.empty(rows, f32), dist,
                         status, _plan_flags(host, vocab, None, True))
    if status_out is None:
        raise_rows(be.to_host(status), "logits")
    return dist


def speculative_accept(be, drafts, draft_indptr, q, p, seed, counter, m_out=None, next_out=None,
                       source_out=None, status_out=None):
    """Lossless speculative accept for a ragged batch of sessions -> (m, next, source), int32 [B].

    Session b has drafts[draft_indptr[b]:draft_indptr[b+1]] (nd_b of them), their drafter rows
    q [nd_total, V] and its nd_b + 1 target columns p[draft_indptr[b] + b:][:nd_b + 1]
    (p [nd_total + B, V]; column j is the distribution after cand[j]), all filtered float32
    distributions. seed and counter (uint64 [B]) name the session's round. m = drafts accepted,
    next = the token after them (residual or bonus, see Source). Acceptance statistics follow
    from (nd_b, m): dspark.stats.SpecStats.record(nd_b, m). Host drafts, indptr, seeds and
    counters are checked on the host and uploaded; with `status_out` (int32 [B]) the sessions'
    statuses go there unread (`raise_accept`), otherwise a bad session raises here."""
    drafts, draft_indptr, q, p, seed, counter, m_out, next_out, source_out, status_out = adopt(
        be, drafts=drafts, draft_indptr=draft_indptr, q=q, p=p, seed=seed, counter=counter, m_out=m_out,
        next_out=next_out, source_out=source_out, status_out=status_out,
        writes=("m_out", "next_out", "source_out", "status_out"))
    host_drafts, drafts = host_and_device(be, drafts, "drafts")
    require_ndim(host_drafts, 1, "drafts", "[nd_total]")
    require_dtype(host_drafts, np.int32, "drafts")
    nd_total = host_drafts.shape[0]
    host_indptr, draft_indptr = host_and_device(be, draft_indptr, "draft_indptr")
    require_indptr(host_indptr, "draft_indptr", nd_total)
    B = host_indptr.shape[0] - 1
    for name, a in (("q", q), ("p", p)):
        require_ndim(a, 2, name, "[rows, V]")
        if a.dtype != np.dtype(f32):
            raise DTypeError(f"{name} has dtype {a.dtype}: expected float32 (filtered distributions)")
    vocab = p.shape[1]
    _check_vocab(vocab, "p")
    require_shape(q, (nd_total, vocab), "q")
    require_shape(p, (nd_total + B, vocab), "p")
    bad = np.flatnonzero((host_drafts < 0) | (host_drafts >= vocab))
    if bad.size:
        raise TokenRangeError(f"drafts[{bad[0]}]={host_drafts[bad[0]]} is outside the vocabulary [0, {vocab})")
    _, seed = _vector(be, seed, B, u64, "seed")
    _, counter = _vector(be, counter, B, u64, "counter")
    outs = [_out(be, o, (B,), np.int32, n) for o, n in ((m_out, "m_out"), (next_out, "next_out"),
                                                         (source_out, "source_out"))]
    status = _status_out(be, status_out, B)
    if be.kernels is None:
        r = speculative_accept_ref(drafts, host_indptr, q, p, seed, counter)
        for o, n in zip(outs, ("m", "next", "source")):
            o[...] = r[n]
        status[...] = r["status"]
    elif B:
        xp = be.xp
        (run,) = accept_plan(B, 0, vocab).launches
        part = xp.empty(run.ctas * PART_WORDS, u64)
        tickets, _ = rowsplit.scratch(be, B)
        rowsplit.launch(be, "spec_accept_f32", run.ctas, run.threads,
                        (drafts, draft_indptr, q, p, np.int32(vocab), seed, counter, *outs, status, part, tickets))
    if status_out is None:
        raise_accept(be.to_host(status))
    return tuple(outs)


def raise_accept(status) -> None:
    """NonFiniteError naming the first session whose accept read something that is not a
    distribution (host statuses [B] of speculative_accept)."""
    bad = np.flatnonzero(np.asarray(status))
    if bad.size:
        raise NonFiniteError(f"q/p: session {bad[0]} reads a probability outside [0, 1] or a target row "
                             f"with no mass ({bad.size} sessions in all)")


def philox_random(be, ctr, key):
    """Philox4x32-10 of counters `ctr` uint32 [n, 4] under keys `key` uint32 [n, 2] ->
    (bits uint32, uniform [0,1) float32, uniform_open (0,1) float32, gumbel float32), each [n, 4]."""
    ctr, key = adopt(be, ctr=ctr, key=key)
    require_ndim(ctr, 2, "ctr", "[n, 4]")
    require_dtype(ctr, u32, "ctr")
    n = ctr.shape[0]
    require_shape(ctr, (n, 4), "ctr")
    require_shape(key, (n, 2), "key")
    require_dtype(key, u32, "key")
    if be.kernels is None:
        return philox_random_ref(ctr, key)
    xp = be.xp
    outs = (xp.empty((n, 4), u32), xp.empty((n, 4), f32), xp.empty((n, 4), f32), xp.empty((n, 4), f32))
    if n:
        grid = min(PHILOX_MAX_BLOCKS, -(-n // PHILOX_THREADS))
        be.kernels.get_function("philox_blocks")((grid,), (PHILOX_THREADS,), (ctr, key, np.int64(n), *outs))
    return outs
