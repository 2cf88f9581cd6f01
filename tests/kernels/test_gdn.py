"""gdn_scan: the kernels (simt, cuda) against the NumPy reference, and exact rollback, with one
key head per value head and with several value heads sharing a key head (Qwen3.5).

Tolerance for floats: |got - ref| <= 1e-5 * (|ref| + max|ref|), the max taken over the whole
tensor: kernel and reference sum in the same order, so they differ only where exp/log1p differ in
the last bit between libraries (and by FMA contraction on a GPU); the max term covers outputs that
are small by cancellation. Conv windows are copies of inputs: compared exactly. Every rollback
property is bitwise (array_equal) on each backend.
"""

import copy
from dataclasses import dataclass

import numpy as np
import pytest

from dspark.errors import CapacityError, DTypeError, KernelArgumentError, ShapeError
from dspark.ops.gdn import channels, gdn_scan, lane_columns
from dspark.ops.snapshot import checkpoint_select, snapshot_restore, snapshot_save
from tests.conftest import poison
from tests.kernels.asan import assert_clean, run_asan

F32 = np.float32
FAMILIES = ["gdn_scan", "snapshot"]


def assert_close(got, ref, what):
    got, ref = np.asarray(got), np.asarray(ref)
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


@dataclass
class Layer:
    """One gdn layer's scan parameters, and a token stream per session."""
    heads: int
    dk: int
    dv: int
    conv_weight: np.ndarray
    A_log: np.ndarray
    dt_bias: np.ndarray
    k_heads: int | None = None

    @property
    def C(self):
        return channels(self.heads, self.dk, self.dv, self.k_heads)

    def stream(self, rng, n):
        """(mixed [n, C], a [n, H], b [n, H]); some a large enough to take softplus's linear branch."""
        a = rng.standard_normal((n, self.heads)).astype(F32)
        a[rng.random(a.shape) < 0.1] = 25.0
        return (rng.standard_normal((n, self.C)).astype(F32), a, (2 * rng.standard_normal((n, self.heads))).astype(F32))

    def fresh_state(self, rng):
        return ((0.3 * rng.standard_normal((self.heads, self.dv, self.dk))).astype(F32),
                rng.standard_normal((self.C, 3)).astype(F32))


def make_layer(rng, heads, dk, dv, k_heads=None):
    C = channels(heads, dk, dv, k_heads)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), heads))
    return Layer(heads, dk, dv, (0.5 * rng.standard_normal((C, 4))).astype(F32),
                 np.log(rng.uniform(1, 16, heads)).astype(F32), (dt + np.log(-np.expm1(-dt))).astype(F32), k_heads)


class Sessions:
    """B sessions on one backend: live state, token streams and how far each has consumed them."""

    def __init__(self, be, layer, rng, B, stream_len=24):
        self.be, self.layer = be, layer
        init = [layer.fresh_state(rng) for _ in range(B)]
        self.states = [be.asarray(s) for s, _ in init]
        self.windows = [be.asarray(w) for _, w in init]
        self.streams = [layer.stream(rng, stream_len) for _ in range(B)]
        self.pos = np.zeros(B, int)

    def clone(self, be=None):
        """Independent copies of the sessions, on `be` (default: the same backend)."""
        c = copy.copy(self)
        c.be = be or self.be
        c.states = [c.be.asarray(self.be.to_host(s).copy()) for s in self.states]
        c.windows = [c.be.asarray(self.be.to_host(w).copy()) for w in self.windows]
        c.pos = self.pos.copy()
        return c

    def batch(self, ts):
        """The next ts[s] tokens of each session as one ragged launch's inputs."""
        parts = [[x[p:p + t] for x in st] for st, p, t in zip(self.streams, self.pos, ts)]
        cat = [np.concatenate([p[i] for p in parts]) if parts else np.zeros((0, n), F32)
               for i, n in enumerate((self.layer.C, self.layer.heads, self.layer.heads))]
        indptr = np.concatenate([[0], np.cumsum(ts)]).astype(np.int32)
        return [self.be.asarray(x) for x in cat], self.be.asarray(indptr)

    def scan(self, ts, ckpt=False, advance=True):
        """(out, state_ckpt, conv_ckpt, col_indptr) of one launch over ts[s] columns per session."""
        be, L = self.be, self.layer
        (mixed, a, b), indptr = self.batch(ts)
        cols = mixed.shape[0]
        out = poison(be.xp, (cols, L.heads, L.dv), F32)
        sc = poison(be.xp, (cols, L.heads, L.dv, L.dk), F32) if ckpt else None
        cc = poison(be.xp, (cols, L.C, 3), F32) if ckpt else None
        gdn_scan(be, mixed, a, b, be.asarray(L.conv_weight), be.asarray(L.A_log), be.asarray(L.dt_bias),
                 self.states, self.windows, indptr, heads=L.heads, dk=L.dk, dv=L.dv, k_heads=L.k_heads, out=out,
                 state_ckpt=sc, conv_ckpt=cc)
        if advance:
            self.pos += np.asarray(ts, dtype=int)
        return out, sc, cc, indptr

    def host(self):
        return [self.be.to_host(s) for s in self.states], [self.be.to_host(w) for w in self.windows]


def assert_states_equal(x, y, what):
    for name, xs, ys in (("state", x[0], y[0]), ("conv window", x[1], y[1])):
        for s, (p, q) in enumerate(zip(xs, ys)):
            np.testing.assert_array_equal(p, q, err_msg=f"{what}: session {s} {name}")


# ---- kernel against the reference ----------------------------------------------------------
CASES = [  # (value heads, key heads (None: as many), dk, dv, columns per session)
    (1, None, 16, 16, [1]),
    (3, None, 16, 64, [3, 1, 8]),
    (1, None, 64, 16, [2, 7, 1, 8, 5, 3, 4]),
    (3, None, 64, 64, [5, 0, 2]),
    (1, None, 128, 128, [8]),
    (3, None, 128, 64, [1, 2, 1]),
    (1, None, 32, 128, [4, 6, 1, 2, 3, 8, 5]),
    (3, None, 16, 16, [0, 0, 0]),
    (1, None, 16, 16, []),
    # several value heads per key head, consecutive (Qwen3.5: 16 key heads, 32 or 48 value heads)
    (6, 2, 16, 24, [3, 1, 5]),
    (6, 3, 32, 40, [2, 0, 7]),
    (4, 1, 128, 48, [1, 3]),
    (9, 3, 64, 16, [4, 1, 1, 2]),
    (2, 1, 16, 128, [6]),
]


@pytest.mark.parametrize("heads,k_heads,dk,dv,ts", CASES,
                         ids=[f"H{h}-Hk{hk or h}-dk{k}-dv{v}-t{t}" for h, hk, k, v, t in CASES])
def test_scan_matches_reference(kernel_backend, numpy_backend, rng, heads, k_heads, dk, dv, ts):
    layer = make_layer(rng, heads, dk, dv, k_heads)
    ref = Sessions(numpy_backend, layer, rng, len(ts))
    got, plain = ref.clone(kernel_backend), ref.clone(kernel_backend)
    r_out, r_sc, r_cc, _ = ref.scan(ts, ckpt=True)
    g_out, g_sc, g_cc, _ = got.scan(ts, ckpt=True)
    to_host = kernel_backend.to_host
    assert_close(to_host(g_out), r_out, "out")
    assert_close(to_host(g_sc), r_sc, "state_ckpt")
    np.testing.assert_array_equal(to_host(g_cc), r_cc, err_msg="conv_ckpt")
    (gs, gw), (rs, rw) = got.host(), ref.host()
    for s in range(len(ts)):
        assert_close(gs[s], rs[s], f"state {s}")
        np.testing.assert_array_equal(gw[s], rw[s], err_msg=f"conv window {s}")
    # Checkpoints are a side output: without them the kernel computes exactly the same.
    p_out, *_ = plain.scan(ts, ckpt=False)
    np.testing.assert_array_equal(to_host(p_out), to_host(g_out))
    assert_states_equal(plain.host(), got.host(), "with and without checkpoints")


def test_cuda_grouped_heads_at_qwen3_5_size(cuda, numpy_backend, rng):
    """Qwen3.5-27B's gdn layer: 48 value heads on 16 key heads, dk = dv = 128; then rollback."""
    layer = make_layer(rng, 48, 128, 128, k_heads=16)
    ref = Sessions(numpy_backend, layer, rng, 4)
    got = ref.clone(cuda)
    ts = [8, 1, 0, 5]
    r, g = ref.scan(ts, ckpt=True), got.scan(ts, ckpt=True)
    for name, x, y in zip(("out", "state_ckpt"), g[:2], r[:2]):
        assert_close(cuda.to_host(x), y, name)
    np.testing.assert_array_equal(cuda.to_host(g[2]), r[2], err_msg="conv_ckpt")
    assert_rollbacks_exact(cuda, layer, rng, [8] * 9, list(range(9)))


def textbook_scan(layer, S, W, mixed, a, b):
    """DESIGN section 6 in float64, written from the formula: S = alpha S (I - beta k k^T) + beta v k^T,
    value head h reading key head h // (H / Hk) as transformers' repeat_interleave does."""
    H, dk, dv = layer.heads, layer.dk, layer.dv
    Hk = layer.k_heads or H
    S, W = S.astype(np.float64), W.astype(np.float64)
    w, outs = layer.conv_weight.astype(np.float64), []
    for x, at, bt in zip(mixed.astype(np.float64), a.astype(np.float64), b.astype(np.float64)):
        full = np.concatenate([W, x[:, None]], axis=1)
        y = (full * w).sum(axis=1)
        y = y / (1 + np.exp(-y))
        W = full[:, 1:]
        q, k, v = y[:Hk * dk].reshape(Hk, dk), y[Hk * dk:2 * Hk * dk].reshape(Hk, dk), y[2 * Hk * dk:].reshape(H, dv)
        q, k = np.repeat(q, H // Hk, axis=0), np.repeat(k, H // Hk, axis=0)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        alpha = np.exp(-np.exp(layer.A_log.astype(np.float64)) * np.logaddexp(0, at + layer.dt_bias))
        beta = 1 / (1 + np.exp(-bt))
        eye = np.eye(dk)
        for h in range(H):
            S[h] = alpha[h] * S[h] @ (eye - beta[h] * np.outer(k[h], k[h])) + beta[h] * np.outer(v[h], k[h])
        outs.append(np.einsum("hvk,hk->hv", S, q))
    return np.array(outs), S, W


@pytest.mark.parametrize("heads,k_heads,dk,dv", [(3, None, 16, 32), (1, None, 128, 64), (6, 2, 16, 24)])
def test_reference_is_the_delta_rule(numpy_backend, rng, heads, k_heads, dk, dv):
    """The fixed evaluation order computes the formula of DESIGN section 6."""
    layer = make_layer(rng, heads, dk, dv, k_heads)
    sess = Sessions(numpy_backend, layer, rng, 1)
    (S0,), (W0,) = sess.host()
    S0, W0 = S0.copy(), W0.copy()
    mixed, a, b = (x[:8] for x in sess.streams[0])
    out, *_ = sess.scan([8])
    t_out, t_S, t_W = textbook_scan(layer, S0, W0, mixed, a, b)
    np.testing.assert_allclose(out, t_out, rtol=1e-4, atol=1e-4 * np.abs(t_out).max())
    np.testing.assert_allclose(sess.states[0], t_S, rtol=1e-4, atol=1e-4 * np.abs(t_S).max())
    np.testing.assert_array_equal(sess.windows[0], t_W.astype(F32))


def test_lane_columns_cover_each_column_once():
    for dk in (16, 32, 64, 128):
        idx = lane_columns(dk)
        np.testing.assert_array_equal(np.sort(idx.ravel()), np.arange(dk))


# ---- row invariance and exact rollback ------------------------------------------------------
def test_a_session_alone_equals_it_in_a_batch(any_backend, rng):
    layer = make_layer(rng, 3, 32, 16)
    batch = Sessions(any_backend, layer, rng, 7)
    alone = batch.clone()
    ts = [3, 8, 1, 5, 2, 7, 4]
    b_out, *_ = batch.scan(ts)
    offsets = np.concatenate([[0], np.cumsum(ts)])
    for s in (0, 3, 6):
        one = alone.clone()
        keep = [t if i == s else 0 for i, t in enumerate(ts)]
        o_out, *_ = one.scan(keep)
        np.testing.assert_array_equal(any_backend.to_host(o_out),
                                      any_backend.to_host(b_out)[offsets[s]:offsets[s + 1]])
        np.testing.assert_array_equal(one.host()[0][s], batch.host()[0][s])


def decode(sess, steps):
    """Plain decode: one column per launch for each session with steps left; the outputs per session."""
    outs = [[] for _ in steps]
    for j in range(max(steps, default=0)):
        ts = [1 if n > j else 0 for n in steps]
        out, *_ = sess.scan(ts)
        out = sess.be.to_host(out)
        for s in np.flatnonzero(ts):
            outs[s].append(out[int(np.sum(ts[:s]))])
    return outs


def verify_and_roll_back(sess, vts, keeps, method):
    """One verify of vts[s] columns, then the rollback to keeps[s] columns; the verify's outputs."""
    be = sess.be
    snap_s = [be.xp.empty_like(s) for s in sess.states]
    snap_w = [be.xp.empty_like(w) for w in sess.windows]
    snapshot_save(be, sess.states + sess.windows, snap_s + snap_w)
    out, sc, cc, indptr = sess.scan(vts, ckpt=True, advance=False)
    if method == "select":
        checkpoint_select(be, sc, cc, sess.states, sess.windows, indptr, be.asarray(np.array(keeps, np.int32)),
                          snap_states=snap_s, snap_convs=snap_w)
        sess.pos += np.asarray(keeps)
    else:  # restore the snapshot, replay the kept columns
        snapshot_restore(be, snap_s + snap_w, sess.states + sess.windows)
        sess.scan(keeps)
    return be.to_host(out), be.to_host(indptr)


@pytest.mark.parametrize("heads,k_heads,dk,dv", [(3, None, 16, 32), (1, None, 64, 128), (6, 3, 32, 24)])
def test_rollback_is_bitwise_plain_decode(any_backend, rng, heads, k_heads, dk, dv):
    """Restore + replay and checkpoint select both give, bitwise, the state of a plain decode
    that fed the kept tokens one at a time, for every keep in 0..vt, across sessions that have
    already consumed different numbers of tokens. Each verify column equals its decode step."""
    layer = make_layer(rng, heads, dk, dv, k_heads)
    extra = rng.integers(1, 9, 3)
    vts = [8] * 9 + extra.tolist()
    keeps = list(range(9)) + [int(rng.integers(0, v + 1)) for v in extra]
    assert_rollbacks_exact(any_backend, layer, rng, vts, keeps)


def assert_rollbacks_exact(be, layer, rng, vts, keeps):
    """Sessions of different lengths verify vts[s] columns and keep keeps[s]: checkpoint select
    and restore + replay both leave, bitwise, the state of plain decode, and every kept verify
    column equals its decode step."""
    live = Sessions(be, layer, rng, len(vts))
    live.scan(rng.integers(0, 6, len(vts)).tolist())  # a ragged prefill: different lengths
    plain, select, replay = live.clone(), live.clone(), live.clone()
    dec_out = decode(plain, keeps)
    v_out, indptr = verify_and_roll_back(select, vts, keeps, "select")
    verify_and_roll_back(replay, vts, keeps, "replay")
    assert_states_equal(select.host(), plain.host(), "checkpoint select vs plain decode")
    assert_states_equal(replay.host(), plain.host(), "restore + replay vs plain decode")
    for s, k in enumerate(keeps):
        for j in range(k):
            np.testing.assert_array_equal(v_out[indptr[s] + j], dec_out[s][j], err_msg=f"session {s} column {j}")


def test_zero_draft_after_full_accept_continues_from_the_right_state(any_backend, rng):
    """The failure seen in engines that select checkpoints lazily: after a full accept (keep =
    vt), the next step reads its starting state from a stale checkpoint slot (the first, or the
    previous round's keep - 1) instead of the state after all vt columns. Here select copies
    eagerly, so a zero-draft round (vt = 1, keep = 1: only the anchor) or a one-column decode step
    right after a full accept continues from the right state, even with the previous round's
    checkpoints still in the reused buffers."""
    layer = make_layer(rng, 3, 16, 32)
    B = 3
    live = Sessions(any_backend, layer, rng, B)
    plain = live.clone()
    be = any_backend

    # Round 1: full accept everywhere (keep = vt), checkpoints into buffers the next round reuses.
    vts1 = [5, 3, 8]
    out, sc, cc, indptr = live.scan(vts1, ckpt=True)
    checkpoint_select(be, sc, cc, live.states, live.windows, indptr, be.asarray(np.array(vts1, np.int32)))
    decode(plain, vts1)
    assert_states_equal(live.host(), plain.host(), "full accept")
    # The stale slots a lazy engine would read hold other states: the check below has teeth.
    sc_host = be.to_host(sc)
    for s in range(B):
        assert not np.array_equal(sc_host[indptr[s]], plain.host()[0][s])

    # Round 2: session 0 a zero-draft round, session 1 a plain one-column decode, session 2 a
    # verify of 4 that keeps only the anchor. The buffers still hold round 1 past each new column.
    zero_draft = live.clone()
    vts2, keeps2 = [1, 0, 4], [1, 0, 1]
    (mixed, a, b), indptr2 = zero_draft.batch(vts2)
    gdn_scan(be, mixed, a, b, be.asarray(layer.conv_weight), be.asarray(layer.A_log), be.asarray(layer.dt_bias),
             zero_draft.states, zero_draft.windows, indptr2, heads=layer.heads, dk=layer.dk, dv=layer.dv,
             state_ckpt=sc[:mixed.shape[0]], conv_ckpt=cc[:mixed.shape[0]])
    checkpoint_select(be, sc[:mixed.shape[0]], cc[:mixed.shape[0]], zero_draft.states, zero_draft.windows, indptr2,
                      be.asarray(np.array(keeps2, np.int32)), snap_states=live.states, snap_convs=live.windows)
    zero_draft.pos += keeps2
    one_step = live.clone()
    one_step.scan([0, 1, 0])
    decode(plain, [1, 1, 1])
    for s in (0, 2):
        for name, x, y in zip(("state", "window"), zero_draft.host(), plain.host()):
            np.testing.assert_array_equal(x[s], y[s], err_msg=f"zero-draft session {s} {name}")
    for name, x, y in zip(("state", "window"), one_step.host(), plain.host()):
        np.testing.assert_array_equal(x[1], y[1], err_msg=f"one-column step {name}")


# ---- debug modes ----------------------------------------------------------------------------
@pytest.mark.parametrize("heads,k_heads,dk,dv,ts", [(3, None, 32, 48, [3, 1, 4]), (1, None, 128, 32, [2, 0, 1]),
                                                   (4, 2, 16, 40, [2, 3])])
def test_random_schedule_gives_the_same_bits(simt, rng, heads, k_heads, dk, dv, ts):
    layer = make_layer(rng, heads, dk, dv, k_heads)
    base = Sessions(simt, layer, rng, len(ts))
    shuffled = base.clone()
    ref = base.scan(ts, ckpt=True)
    with simt.kernels.schedule(int(rng.integers(1, 2**31))):
        got = shuffled.scan(ts, ckpt=True)
    for x, y in zip(got[:3], ref[:3]):
        np.testing.assert_array_equal(x, y)
    assert_states_equal(shuffled.host(), base.host(), "random schedule")


ASAN_SCRIPT = """
from dspark.ops.gdn import channels, gdn_scan
rng = np.random.default_rng(7)
numpy_be = dspark.get_backend("numpy")
for heads, kh, dk, dv, ts in [(2, 2, 16, 16, [2, 0, 3]), (1, 1, 128, 32, [2]), (1, 1, 64, 96, [1, 1]),
                              (6, 2, 32, 24, [1, 2])]:
    C, cols, B = channels(heads, dk, dv, kh), sum(ts), len(ts)
    args = [rng.standard_normal(s).astype(np.float32) for s in [(cols, C), (cols, heads), (cols, heads), (C, 4),
                                                               (heads,), (heads,)]]
    init = [(rng.standard_normal((heads, dv, dk)).astype(np.float32), rng.standard_normal((C, 3)).astype(np.float32))
            for _ in ts]
    indptr = np.concatenate([[0], np.cumsum(ts)]).astype(np.int32)
    res = []
    for b in (be, numpy_be):
        S, W = [s.copy() for s, _ in init], [w.copy() for _, w in init]
        sc, cc = np.empty((cols, heads, dv, dk), np.float32), np.empty((cols, C, 3), np.float32)
        out = gdn_scan(b, *args, S, W, indptr, heads=heads, dk=dk, dv=dv, k_heads=kh, state_ckpt=sc, conv_ckpt=cc)
        res.append([out, sc, cc, *S, *W])
    for x, y in zip(*res):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(y).max(initial=0))))
print("ok")
"""


def test_asan_clean(simt):
    r = run_asan(ASAN_SCRIPT, families=FAMILIES)
    assert_clean(r)
    assert "ok" in r.stdout


# ---- bad input ------------------------------------------------------------------------------
def test_bad_inputs_are_refused_and_change_nothing(any_backend, rng):
    be = any_backend
    layer = make_layer(rng, 2, 16, 32)
    sess = Sessions(be, layer, rng, 2)
    before = [[x.copy() for x in group] for group in sess.host()]
    (mixed, a, b), indptr = sess.batch([2, 1])
    w, A_log, dtb = (be.asarray(x) for x in (layer.conv_weight, layer.A_log, layer.dt_bias))

    def call(**kw):
        args = dict(mixed=mixed, a=a, b=b, conv_weight=w, A_log=A_log, dt_bias=dtb, states=sess.states,
                    conv_windows=sess.windows, col_indptr=indptr, heads=2, dk=16, dv=32)
        args.update(kw)
        gdn_scan(be, **args)

    with pytest.raises(ShapeError, match="dk=48: expected one of 16, 32, 64, 128"):
        call(dk=48)
    with pytest.raises(ShapeError, match="k_heads=3: expected an int >= 1 that divides heads=2"):
        call(k_heads=3)
    with pytest.raises(ShapeError, match=r"mixed has shape \(3, 128\): expected \(3, 96\)"):
        call(k_heads=1)  # one key head: fewer channels than mixed has
    with pytest.raises(CapacityError, match="dv=200 with dk=128 needs 800 threads per head: expected dv <= 128"):
        call(dk=128, dv=200)
    with pytest.raises(DTypeError, match="mixed has dtype float64: expected float32"):
        call(mixed=mixed.astype(np.float64))
    with pytest.raises(ShapeError, match=r"mixed has shape \(3, 127\): expected \(3, 128\)"):
        call(mixed=be.xp.ascontiguousarray(mixed[:, :127]))
    with pytest.raises(ShapeError, match=r"a has shape \(3, 3\): expected \(3, 2\)"):
        call(a=be.xp.zeros((3, 3), F32))
    with pytest.raises(ShapeError, match="states has 1 arrays: expected 2, one per session"):
        call(states=sess.states[:1])
    with pytest.raises(ShapeError, match=r"states\[1\] has shape \(2, 16, 32\): expected \(2, 32, 16\)"):
        call(states=[sess.states[0], be.xp.zeros((2, 16, 32), F32)])
    with pytest.raises(ShapeError, match="col_indptr must start at 0 and end at 3"):
        call(col_indptr=be.asarray(np.array([0, 2, 4], np.int32)))
    with pytest.raises(ShapeError, match="non-decreasing"):
        call(col_indptr=be.asarray(np.array([0, 4, 3], np.int32)))
    with pytest.raises(KernelArgumentError, match=r"states\[0\] starts at an address that is not 16-byte aligned"):
        flat = be.xp.zeros(2 * 32 * 16 + 1, F32)
        call(states=[flat[1:].reshape(2, 32, 16), sess.states[1]])
    with pytest.raises(KernelArgumentError, match=r"conv_windows\[1\] is not C-contiguous"):
        call(conv_windows=[sess.windows[0], be.xp.zeros((3, layer.C), F32).T])
    with pytest.raises(ShapeError, match=r"out has shape \(3, 2, 31\): expected \(3, 2, 32\)"):
        call(out=be.xp.zeros((3, 2, 31), F32))
    with pytest.raises(ShapeError, match=r"state_ckpt has shape \(2, 2, 32, 16\): expected \(3, 2, 32, 16\)"):
        call(state_ckpt=be.xp.zeros((2, 2, 32, 16), F32))
    assert_states_equal(sess.host(), before, "a refused call")


def test_empty_batch(any_backend, rng):
    layer = make_layer(rng, 1, 16, 16)
    sess = Sessions(any_backend, layer, rng, 0)
    out, sc, cc, _ = sess.scan([], ckpt=True)
    assert out.shape == (0, 1, 16) and sc.shape == (0, 1, 16, 16) and cc.shape == (0, layer.C, 3)


# ---- the fused layer: conv, scan and gated output norm in one launch, inputs read from the projection --------
def fused_call(be, layer, proj, states, windows, indptr, **kw):
    from dspark.ops.gdn import ProjLayout, gdn_layer
    return gdn_layer(be, proj, be.asarray(layer.conv_weight), be.asarray(layer.A_log), be.asarray(layer.dt_bias),
                     states, windows, indptr, heads=layer.heads, dk=layer.dk, dv=layer.dv, k_heads=layer.k_heads,
                     layout=ProjLayout.packed(layer.heads, layer.dk, layer.dv, layer.k_heads), **kw)


@pytest.mark.parametrize("heads,k_heads,dk,dv,ts", [(3, None, 16, 32, [2, 0, 3]), (6, 2, 32, 24, [3, 1]),
                                                   (4, 1, 128, 48, [1, 4])])
def test_fused_layer_matches_its_reference(kernel_backend, rng, heads, k_heads, dk, dv, ts):
    """The gated norm (kernel's lane order: rmsnorm_ref) after the scan, the checkpoints and the
    committed state and windows (several value heads sharing a key head write its window once)."""
    from dspark.ops.gdn import gdn_layer_ref, gdn_proj
    from dspark.ops.norm import rmsnorm_ref
    be, layer = kernel_backend, make_layer(rng, heads, dk, dv, k_heads)
    init = [layer.fresh_state(rng) for _ in ts]
    cols = sum(ts)
    mixed, a, b = layer.stream(rng, cols)
    z = rng.standard_normal((cols, heads * dv)).astype(F32)
    proj, o_norm = gdn_proj(mixed, a, b, z), rng.standard_normal(dv).astype(F32)
    indptr = np.concatenate([[0], np.cumsum(ts)]).astype(np.int32)
    states, windows = [be.asarray(s.copy()) for s, _ in init], [be.asarray(w.copy()) for _, w in init]
    out, sc = poison(be.xp, (cols, heads, dv), F32), poison(be.xp, (cols, heads, dv, dk), F32)
    cc = poison(be.xp, (cols, layer.C, 3), F32)
    fused_call(be, layer, be.asarray(proj), states, windows, indptr, o_norm=be.asarray(o_norm), out=out, state_ckpt=sc,
               conv_ckpt=cc)
    from dspark.ops.gdn import ProjLayout
    rs, rw = [s.copy() for s, _ in init], [w.copy() for _, w in init]
    r_out, r_sc, r_cc = np.zeros((cols, heads, dv), F32), np.zeros((cols, heads, dv, dk), F32), np.zeros((cols, layer.C, 3), F32)
    gdn_layer_ref(proj, ProjLayout.packed(heads, dk, dv, k_heads), layer.conv_weight, layer.A_log, layer.dt_bias, rs,
                  rw, indptr, heads, dk, dv, r_out, r_sc, r_cc, k_heads, True, None, o_norm, 1e-6, norm=rmsnorm_ref)
    assert_close(be.to_host(out), r_out, "gated out")
    assert_close(be.to_host(sc), r_sc, "state_ckpt")
    np.testing.assert_array_equal(be.to_host(cc), r_cc, err_msg="conv_ckpt")
    for s, w, x, y in zip(states, windows, rs, rw):
        assert_close(be.to_host(s), x, "state")
        np.testing.assert_array_equal(be.to_host(w), y, err_msg="window")


def test_fused_replay_of_kept_columns_equals_checkpoint_select_and_its_schedule(simt, rng):
    """Replay (col_count: the first keep columns of each session's verify, from the projection the
    verify read) leaves bitwise the state a checkpoint select does, under any thread schedule (the
    key head's window is written back by the last of its value heads to read it)."""
    from dspark.ops.gdn import gdn_proj
    from dspark.ops.snapshot import checkpoint_select_layers
    layer = make_layer(rng, 6, 16, 24, 2)
    ts, keep = [4, 3], np.array([2, 0], np.int32)
    init = [layer.fresh_state(rng) for _ in ts]
    mixed, a, b = layer.stream(rng, sum(ts))
    proj = gdn_proj(mixed, a, b, np.zeros((sum(ts), 6 * 24), F32))
    indptr = np.concatenate([[0], np.cumsum(ts)]).astype(np.int32)
    live = [[s.copy() for s, _ in init], [w.copy() for _, w in init]]
    sc, cc = np.empty((7, 6, 24, 16), F32), np.empty((7, layer.C, 3), F32)
    fused_call(simt, layer, proj, live[0], live[1], indptr, state_ckpt=sc, conv_ckpt=cc, commit=False)
    selected = [[s.copy() for s in live[0]], [w.copy() for w in live[1]]]
    checkpoint_select_layers(simt, [sc], [cc], selected[0], selected[1], indptr, keep)
    for seed in (None, 3, 11):
        replayed = [[s.copy() for s, _ in init], [w.copy() for _, w in init]]
        if seed is None:
            fused_call(simt, layer, proj, replayed[0], replayed[1], indptr, col_count=keep, want_out=False)
        else:
            with simt.kernels.schedule(seed):
                fused_call(simt, layer, proj, replayed[0], replayed[1], indptr, col_count=keep, want_out=False)
        assert_states_equal(replayed, selected, f"replay (schedule {seed})")


# ---- the scan in the kernel's own order: bitwise, at every slice of a head's rows --------------------------------
def butterfly(p, lanes):
    """Each lane's sum after the xor butterfly over the last axis (`lanes` wide): what gdn_row_sum and
    warp_sum give every lane."""
    lane, o = np.arange(lanes), lanes // 2
    while o:
        p = (p + p[..., lane ^ o]).astype(F32)
        o //= 2
    return p[..., 0]


def lane_dot(S, x, dk):
    """sum_c S[..., c] x[c] as GdnTile<dk> adds it: thread part p of a row adds its columns 4 (p + lanes g)
    + e in order g, e (from 0), then the lanes' butterfly."""
    lanes = dk // min(dk, 32)
    cols = lane_columns(dk)   # [lanes, its columns in the order it adds them]
    acc = np.zeros(S.shape[:-1] + (lanes,), F32)
    for m in range(cols.shape[1]):
        acc = (acc + S[..., cols[:, m]] * x[cols[:, m]]).astype(F32)
    return butterfly(acc, lanes)


def warp_ordered_sum_sq(x):
    """sum x^2 as one warp adds it: lane l adds x[l], x[l + 32], ... in order, then warp_sum."""
    n = -(-x.size // 32) * 32
    padded = np.zeros(n, F32)
    padded[: x.size] = x
    ss = np.zeros(32, F32)
    for r in range(n // 32):
        ss = (ss + padded[32 * r : 32 * r + 32] * padded[32 * r : 32 * r + 32]).astype(F32)
    return butterfly(ss, 32)


def exact_regime_scan(heads, k_heads, dk, dv, cols, rng):
    """Inputs under which the scan's transcendental steps are exact in any libm (A_log -inf: alpha 1;
    b 200: beta 1; conv outputs and z above 110: SiLU(y) = y, exp(-y) being 0), so a NumPy twin can
    follow every sum and rounding of the kernel bit for bit."""
    C = channels(heads, dk, dv, k_heads)
    window = rng.uniform(60, 90, (C, 3)).astype(F32)
    weight = rng.uniform(0.5, 1.0, (C, 4)).astype(F32)
    mixed = rng.uniform(60, 90, (cols, C)).astype(F32)
    z = rng.uniform(110, 140, (cols, heads * dv)).astype(F32)
    a, b = rng.standard_normal((cols, heads)).astype(F32), np.full((cols, heads), 200, F32)
    state = (0.01 * rng.standard_normal((heads, dv, dk))).astype(F32)
    return window, weight, mixed, z, a, b, state


def scan_twin(heads, k_heads, dk, dv, window, weight, mixed, z, state, o_norm, eps):
    """gdn_scan's arithmetic in its order for one session in exact_regime_scan: conv ((w0 x0 + w1 x1) +
    w2 x2) + w3 x, the warp's L2 norms, S k and S q in the lane order (alpha = beta = 1: u = S k;
    S += (v - u) k^T; o = S q), the gated norm's warp-ordered sum. -> (out [cols, H, dv], state, window)."""
    group, S, win = heads // k_heads, state.copy(), window.copy()
    out = np.zeros((mixed.shape[0], heads, dv), F32)
    q_scale = F32(1) / np.sqrt(F32(dk))
    for t in range(mixed.shape[0]):
        y = (weight[:, 0] * win[:, 0] + weight[:, 1] * win[:, 1] + weight[:, 2] * win[:, 2] + weight[:, 3] * mixed[t]
             ).astype(F32)
        win = np.concatenate([win[:, 1:], mixed[t][:, None]], axis=1)
        for h in range(heads):
            kh = h // group
            q, k = y[kh * dk : kh * dk + dk], y[(k_heads + kh) * dk : (k_heads + kh) * dk + dk]
            v = y[2 * k_heads * dk + h * dv : 2 * k_heads * dk + (h + 1) * dv]
            q = (q * (F32(1) / np.sqrt(warp_ordered_sum_sq(q) + F32(1e-6))) * q_scale).astype(F32)
            k = (k * (F32(1) / np.sqrt(warp_ordered_sum_sq(k) + F32(1e-6))) * F32(1)).astype(F32)
            u = lane_dot(S[h], k, dk)
            S[h] = (S[h] + (v - u)[:, None] * k[None, :]).astype(F32)
            o = lane_dot(S[h], q, dk)
            r = np.sqrt(warp_ordered_sum_sq(o) / F32(dv) + F32(eps))
            out[t, h] = ((o / r) * o_norm) * z[t, h * dv : (h + 1) * dv]
    return out, S, win


@pytest.mark.parametrize("heads,k_heads,dk,dv,cols", [(4, 2, 128, 128, 3), (3, 1, 64, 130, 2), (6, 3, 32, 72, 2),
                                                      (2, 2, 16, 40, 3)])
def test_the_scan_is_its_kernel_order_twin_at_every_slice(simt, rng, heads, k_heads, dk, dv, cols):
    """The fused scan, bitwise, against a NumPy twin that follows its every sum and rounding (the lane
    order of S k and S q and their butterfly, the warps' L2 and output norms, the conv's order), for
    each block size of a head's state rows: one block a head (the scan before it was sliced), the plan's
    slices, and ragged ones. A sum taken in another order, or a slice that reads another slice's rows,
    shows in the bits."""
    from dspark.ops.gdn import ProjLayout, gdn_layer, gdn_proj, slice_rows
    window, weight, mixed, z, a, b, state = exact_regime_scan(heads, k_heads, dk, dv, cols, rng)
    o_norm, eps = rng.standard_normal(dv).astype(F32), 1e-6
    want, want_state, want_win = scan_twin(heads, k_heads, dk, dv, window, weight, mixed, z, state, o_norm, eps)
    proj = gdn_proj(mixed, a, b, z)
    top = slice_rows(dk, dv)
    for rows in sorted({top, max(1, top // 2), max(1, top // 3)} | ({dv} if dv <= top else set())):
        s, w = [simt.asarray(state.copy())], [simt.asarray(window.copy())]
        out = poison(simt.xp, (cols, heads, dv), F32)
        gdn_layer(simt, proj, weight, np.full(heads, -np.inf, F32), np.zeros(heads, F32), s, w,
                  np.array([0, cols], np.int32), heads=heads, dk=dk, dv=dv, k_heads=k_heads,
                  layout=ProjLayout.packed(heads, dk, dv, k_heads), o_norm=o_norm, eps=eps, out=out, block_rows=rows)
        np.testing.assert_array_equal(simt.to_host(out).view(np.uint32), want.view(np.uint32), err_msg=f"out, {rows} rows")
        np.testing.assert_array_equal(simt.to_host(s[0]).view(np.uint32), want_state.view(np.uint32),
                                      err_msg=f"state, {rows} rows")
        np.testing.assert_array_equal(simt.to_host(w[0]), want_win, err_msg=f"window, {rows} rows")
